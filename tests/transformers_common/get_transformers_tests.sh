#!/usr/bin/env bash
# Assemble transformers' own common model tests, for the INSTALLED transformers version, in a folder outside this
# repository, for the opt-in harness tests/transformers_common/ (run it with HF_PERFORMER_TRANSFORMERS_TESTS=DEST).
#
#   tests/transformers_common/get_transformers_tests.sh DEST [SDIST]
#
# DEST   the folder to create; it receives DEST/tests/{test_modeling_common,test_configuration_common,...}.py
# SDIST  transformers-<version>.tar.gz already on disk; without it the sdist of the installed version is fetched from
#        PyPI with `pip download --no-deps --no-binary :all: transformers==<version>` (a package-registry fetch).
# PYTHON the interpreter whose transformers version is used (default: python3 on PATH).
#
# What the sdist does NOT hold, and how the harness copes:
# - tests/generation/test_utils.py (GenerationTesterMixin) and tests/exporters/test_export.py (ExportTesterMixin, a
#   base class of ModelTesterMixin; GenerationTesterMixin imports it as `tests.exporters.test_export`) are not in the
#   sdist. They are read once from a git copy of transformers (no other download is possible here):
#       TRANSFORMERS_GIT=/path/to/transformers/.git [TRANSFORMERS_GIT_REF=v<version>] get_transformers_tests.sh DEST
#   TRANSFORMERS_GIT_REF defaults to the installed version's tag; name another tag when that one is not in the copy
#   (the script says which tag it used, in DEST/SOURCES). Without TRANSFORMERS_GIT, placeholder modules with empty
#   mixins marked PLACEHOLDER are written: test_modeling_common.py still imports, the harness runs the model and
#   config tests only and reports the generation tests as not run.
# - tests/utils/test_configuration_utils.py (imported by test_configuration_common.py for its `config_common_kwargs`)
#   is not in the sdist: unless a real copy is there, a module holding only that table, as transformers 5's file
#   defines it, is written.
# - test_modeling_common.py imports `parameterized` (a transformers test dependency, not installed with it): it is
#   installed with pip into DEST/_deps (not into the environment); the harness puts DEST/_deps on sys.path.
# Nothing of this folder is ever committed to this repository.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 DEST [transformers-<version>.tar.gz]   (DEST: folder to create, outside the repository)" >&2
    exit 2
fi
dest=$1
sdist=${2:-}
python=${PYTHON:-python3}
version=$("$python" -c "import transformers; print(transformers.__version__)")

repo_root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
case "$dest/" in
    "$repo_root"/*) echo "$0: DEST must be outside the repository ($repo_root); got $dest" >&2; exit 2 ;;
esac

if [ -z "$sdist" ]; then
    download_dir=$(mktemp -d)
    trap 'rm -rf "$download_dir"' EXIT
    "$python" -m pip download --quiet --no-deps --no-binary :all: "transformers==$version" -d "$download_dir"
    sdist=$(ls "$download_dir"/transformers-*.tar.gz)
fi
case "$(basename "$sdist")" in
    "transformers-$version.tar.gz") ;;
    *) echo "$0: $sdist is not the sdist of the installed transformers $version (transformers-$version.tar.gz)" >&2
       exit 2 ;;
esac

# The tests/ folder of the sdist (common mixins only: the per-model test folders are not shipped).
tar -xzf "$sdist" -C "$dest" --strip-components=1 "transformers-$version/tests"
touch "$dest/tests/__init__.py"
mkdir -p "$dest/tests/generation" "$dest/tests/exporters"
touch "$dest/tests/generation/__init__.py" "$dest/tests/exporters/__init__.py"

echo "tests/ from $(basename "$sdist")" > "$dest/SOURCES"
if [ -n "${TRANSFORMERS_GIT:-}" ]; then
    ref=${TRANSFORMERS_GIT_REF:-v$version}
    if ! git --git-dir="$TRANSFORMERS_GIT" rev-parse --verify --quiet "$ref^{commit}" > /dev/null; then
        echo "$0: $ref is not in $TRANSFORMERS_GIT; set TRANSFORMERS_GIT_REF to the closest tag it has" \
             "(git --git-dir=$TRANSFORMERS_GIT tag -l 'v5*')" >&2
        exit 2
    fi
    for file in tests/generation/test_utils.py tests/exporters/test_export.py; do
        git --git-dir="$TRANSFORMERS_GIT" show "$ref:$file" > "$dest/$file"
        echo "$file from git $ref ($(git --git-dir="$TRANSFORMERS_GIT" rev-parse "$ref^{commit}"))" >> "$dest/SOURCES"
    done
fi

write_placeholder() {  # file, class names, what is not run
    if [ ! -f "$1" ]; then
        {
            echo "# PLACEHOLDER written by get_transformers_tests.sh: transformers $version's sdist does not ship this file."
            echo "# Replace it with the file of tag v$version (TRANSFORMERS_GIT=...) to run $3."
            echo "PLACEHOLDER = True"
            for class_name in $2; do
                printf '\n\nclass %s:\n    """Empty stand-in so that test_modeling_common.py imports; no %s run."""\n' \
                    "$class_name" "$3"
            done
        } > "$1"
        echo "$1: placeholder (no $3)" >> "$dest/SOURCES"
    fi
}
write_placeholder "$dest/tests/generation/test_utils.py" GenerationTesterMixin "the generation tests"
write_placeholder "$dest/tests/exporters/test_export.py" "ExportTesterMixin ExportGenerateTesterMixin" "the export tests"

mkdir -p "$dest/tests/utils"
touch "$dest/tests/utils/__init__.py"
if [ ! -f "$dest/tests/utils/test_configuration_utils.py" ]; then
    cat > "$dest/tests/utils/test_configuration_utils.py" <<'PYTHON'
# Written by get_transformers_tests.sh: the sdist does not ship tests/utils/; this is the one name
# test_configuration_common.py imports from it, as transformers 5's tests/utils/test_configuration_utils.py defines it.
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
PYTHON
fi
if ! PYTHONPATH="$dest/_deps" "$python" -c "import parameterized" 2>/dev/null; then
    "$python" -m pip install --quiet --no-deps --target "$dest/_deps" "parameterized>=0.9"
fi
echo "$version" > "$dest/TRANSFORMERS_VERSION"
cat "$dest/SOURCES"
echo "transformers $version tests in $dest/tests; run:"
echo "  HF_PERFORMER_TRANSFORMERS_TESTS=$dest/tests python -m pytest tests/transformers_common"
