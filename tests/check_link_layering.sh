#!/usr/bin/env bash
# The layering at link time: every layer is one static library (src/CMakeLists.txt), and this
# checks, for each, that
#   - its link line names only libraries of the folders src/layers.cmake allows it, and
#   - none of its objects calls a function (or uses data) that a library of a folder it may not
#     use defines: the call an #include check cannot see (a declaration written by hand, a
#     definition in the wrong folder).
# Usage: check_link_layering.sh LAYERS_FILE, whose lines (tests/CMakeLists.txt writes them) are
#   <folder>|<archive>|<folders it may use, space-separated>|<folders its link line names>
# A folder may have several lines (several archives). Prints each violation as
#   "<folder>/<object>: calls <symbol>, defined in <other folder>/<object> (<folder> may use: ...)"
# and exits 1 when there is one.
set -euo pipefail
export LC_ALL=C  # one collation for sort and join
layers=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

declare -A archives allowed
violations=0
while IFS='|' read -r folder archive may links; do
  [ -n "$folder" ] || continue
  archives[$folder]+=" $archive"
  allowed[$folder]=" $may "
  for linked in $links; do
    if [[ "${allowed[$folder]}" != *" $linked "* ]]; then
      echo "$folder: its library links $linked's ($folder may use:${allowed[$folder]% })"
      violations=$((violations + 1))
    fi
  done
done < "$layers"

# Strong definitions (code, data, read-only data, bss) of each folder's archives, as
# "<symbol> <object>", and its objects' undefined symbols as "<symbol> <object>".
for folder in "${!archives[@]}"; do
  for archive in ${archives[$folder]}; do
    nm -A -g --defined-only "$archive" | awk '$(NF-1) ~ /^[TDBR]$/ { split($1, p, ":"); print $NF, p[2] }'
  done | sort -u -k1,1 > "$work/defined.$folder"
  for archive in ${archives[$folder]}; do
    nm -A -u "$archive" | awk '$(NF-1) == "U" { split($1, p, ":"); print $NF, p[2] }'
  done | sort -k1,1 > "$work/undefined.$folder"
done

for folder in "${!archives[@]}"; do
  for other in "${!archives[@]}"; do
    [[ "$other" != "$folder" && "${allowed[$folder]}" != *" $other "* ]] || continue
    while read -r symbol user definer; do
      echo "$folder/$user: calls $(c++filt "$symbol"), defined in $other/$definer ($folder may use:${allowed[$folder]% })"
      violations=$((violations + 1))
    done < <(join "$work/undefined.$folder" "$work/defined.$other")
  done
done

if [ "$violations" -gt 0 ]; then
  echo "check_link_layering: $violations violation(s)"
  exit 1
fi
echo "check_link_layering: ${#archives[@]} layers, no call into a layer a library may not use"
