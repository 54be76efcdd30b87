#!/bin/sh
# Includes point one way: base <- format <- {tokenizer, backend} <- {model, experts} <- runtime
# <- server <- app. Lists every #include "dir/..." in src/ that a folder may not use; exit 1 if any.
cd "$(dirname "$0")/.." || exit 2
allowed() {
    case "$1" in
    base) echo "base" ;;
    format) echo "base format" ;;
    tokenizer) echo "base format tokenizer" ;;
    backend) echo "base backend" ;;
    experts) echo "base format backend experts" ;;
    model) echo "base format backend experts model" ;;
    runtime) echo "base format tokenizer backend experts model runtime" ;;
    server) echo "base format tokenizer backend experts model runtime server" ;;
    esac
}
bad=0
for f in $(find src -name '*.[ch]' -o -name '*.inc'); do
    layer=$(echo "$f" | cut -d/ -f2)
    for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([a-z_]*\)\/.*"/\1/p' "$f"); do
        case " $(allowed "$layer") " in
        *" $inc "*) ;;
        *) echo "check_deps: $f includes $inc/ (a $layer file may use: $(allowed "$layer"))"; bad=1 ;;
        esac
    done
done
[ $bad -eq 0 ] && echo "check_deps: include directions OK"
exit $bad
