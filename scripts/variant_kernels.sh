#!/usr/bin/env bash
# A candidate's kernels/ for an A/B line, built on the host from a diff kept in git history.
# Usage: scripts/variant_kernels.sh DEST DIFF...
#   DEST  a folder that will hold DEST/kernels (an A/B line names DEST/kernels), for example
#         ab_r68/k/inplace; /ab_*/ is git-ignored, so pass it to the device tool's `carry`
#   DIFF  REV:PATH of a diff in git history (git show REV:PATH), or a file; applied in turn
#         to HEAD in a scratch worktree
# Refuses (exit 3) when the result's kernels are HEAD's: an A/B of main against itself.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,8p "$0"; exit 2; }
dest=$1; shift
root=$(git rev-parse --show-toplevel)
tree=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tree" > /dev/null 2>&1 || rm -rf "$tree"' EXIT
git -C "$root" worktree add -q --detach "$tree" HEAD
for diff in "$@"; do  # into the index too, so that a file a diff adds counts below
  if [ -f "$diff" ]; then git -C "$tree" apply --index "$(realpath "$diff")"
  else git -C "$root" show "$diff" | git -C "$tree" apply --index
  fi
done
if git -C "$tree" diff --cached --quiet HEAD -- kernels; then
  echo "$dest: the diffs leave HEAD's kernels unchanged: nothing to compare" >&2
  exit 3
fi
rm -rf "$dest/kernels"
mkdir -p "$dest"
cp -r "$tree/kernels" "$dest/kernels"
echo "$dest/kernels: HEAD $(git -C "$root" rev-parse --short HEAD) with $*"
