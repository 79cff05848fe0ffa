# Sourced first by the project's shell scripts, with their arguments: given -h or --help, prints
# the calling script's header comment (its lines from the second to its `set`) and exits 0.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[1]}"
    exit 0
fi
