#!/usr/bin/env bash
# Here, not on the device: the folders a device call carries to A/B candidates against HEAD.
#   bash benchmarks/candidates/prepare.sh fixed_tile_col32 fixed_tile_single_range_128x256
# makes .cand_<name> = `git archive HEAD` plus the named patches up to and including <name> (they
# stack, in the order given), and prints the carry list and the device command, one `ab_builds.sh` per build:
# ORDER=before runs the candidate as the "before" build, so its JSONs are before_<stage>_<name>.json;
# the base (HEAD itself, this tree) runs once with ORDER=after, TAG=_base. Pass the workload in
# STAGES / W1ARGS / B1ARGS / EXTRA as for ab_builds.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ $# -ge 1 ] || { echo "usage: $0 PATCH_NAME..." >&2; exit 2; }
head=$(git rev-parse --short HEAD)
rm -rf .cand_*
prev=""
carry=()
for name in "$@"; do
  p=benchmarks/candidates/$name.patch
  [ -f "$p" ] || { echo "no $p" >&2; exit 2; }
  d=.cand_$name
  if [ -z "$prev" ]; then mkdir "$d" && git archive HEAD | tar -x -C "$d"; else cp -r "$prev" "$d"; fi
  patch -p1 -s -d "$d" < "$p"
  grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
  prev=$d
  carry+=("\"$d\"")
done
echo "carry: [$(IFS=,; echo "${carry[*]}")]"
cmd="ORDER=after TAG=_base AFTER_COMMIT=$head BEFORE=.cand_$1 bash benchmarks/scripts/ab_builds.sh"
for name in "$@"; do
  cmd+="; ORDER=before TAG=_$name BEFORE=.cand_$name BEFORE_COMMIT=$head+$name bash benchmarks/scripts/ab_builds.sh"
done
echo "command (after exporting STAGES, W1ARGS / B1ARGS, EXTRA, LIMIT): $cmd"
