#!/bin/sh
# Includes point one way: base <- format <- {tokenizer, backend} <- {model, experts, grammar}
# <- runtime <- server <- app (grammar: on base and tokenizer alone). Lists every #include "dir/..." in src/ and app/ (C, headers, CUDA) that a
# folder may not use; a backend's own folder (backend/cuda/...) is reached from src/backend alone,
# everything above it opens backends through backend/backend.h. Exit 1 if any.
cd "$(dirname "$0")/.." || exit 2
allowed() {
    case "$1" in
    base) echo "base" ;;
    format) echo "base format" ;;
    tokenizer) echo "base format tokenizer" ;;
    backend) echo "base backend" ;;
    experts) echo "base format backend experts" ;;
    model) echo "base format backend experts model" ;;
    grammar) echo "base format tokenizer grammar" ;;
    runtime) echo "base format tokenizer backend experts model grammar runtime" ;;
    server) echo "base format tokenizer backend experts model grammar runtime server" ;;
    app) echo "base format tokenizer backend experts model grammar runtime server" ;;
    esac
}
bad=0
for f in $(find src app \( -name '*.[ch]' -o -name '*.inc' -o -name '*.cu' -o -name '*.cuh' \) | sort); do
    layer=$(echo "$f" | cut -d/ -f2)
    [ "${f%%/*}" = app ] && layer=app
    for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([a-z_]*\/[a-z_]*\).*"/\1/p' "$f"); do
        dir=${inc%%/*}
        case " $(allowed "$layer") " in
        *" $dir "*) ;;
        *) echo "check_deps: $f includes $dir/ (a $layer file may use: $(allowed "$layer"))"; bad=1 ;;
        esac
        case "$inc" in
        backend/cuda | backend/cpu)
            case "$f" in src/backend/*) ;; *) echo "check_deps: $f includes $inc/ (above src/backend, use backend/backend.h)"; bad=1 ;; esac ;;
        esac
    done
done
[ $bad -eq 0 ] && echo "check_deps: include directions OK"
exit $bad
