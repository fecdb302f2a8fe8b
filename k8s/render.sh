#!/bin/sh
# Render one k8s/ template with the values of k8s/params.env and optional override files
# (later files win). Plain POSIX sh + sed: nothing to install.
# Usage: k8s/render.sh cluster|train|precompile|consolidate|inference|selftest [OVERRIDES.env ...] | kubectl apply -f -
set -eu
dir=$(cd "$(dirname "$0")" && pwd)
usage="usage: $0 cluster|train|precompile|consolidate|inference|selftest [OVERRIDES.env ...]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
tmpl="$dir/$1.yaml"
shift
[ -f "$tmpl" ] || { echo "$0: no template $tmpl; $usage" >&2; exit 2; }
script=""
for f in "$dir/params.env" "$@"; do
  [ -f "$f" ] || { echo "$0: no such env file: $f" >&2; exit 2; }
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in '' | '#'*) continue ;; esac
    key=${line%%=*}
    val=$(printf '%s' "${line#*=}" | sed 's/[\\|&]/\\&/g')
    # prepend, so that a later file's value is substituted first (later files win)
    script="s|\${$key}|$val|g
$script"
  done < "$f"
done
out=$(sed "$script" "$tmpl")
if printf '%s\n' "$out" | grep -n '\${[A-Za-z_]' >&2; then
  echo "$0: unset variables above (define them in k8s/params.env)" >&2
  exit 1
fi
printf '%s\n' "$out"
