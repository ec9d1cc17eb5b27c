#!/usr/bin/env bash
# Assemble transformers' own common model tests, for the INSTALLED transformers version, in a folder outside this
# repository, for the opt-in harness tests/transformers_common/ (run it with HF_PERFORMER_TRANSFORMERS_TESTS=DEST).
#
#   benchmarks/scripts/get_transformers_tests.sh DEST [SDIST]
#
# DEST   the folder to create; it receives DEST/tests/{test_modeling_common,test_configuration_common,...}.py
# SDIST  transformers-<version>.tar.gz already on disk; without it the sdist of the installed version is fetched from
#        PyPI with `pip download --no-deps --no-binary :all: transformers==<version>` (a package-registry fetch).
# PYTHON the interpreter whose transformers version is used (default: python3 on PATH).
#
# What the sdist does NOT hold, and how the harness copes:
# - tests/generation/test_utils.py (GenerationTesterMixin) is not in the sdist. Copy it by hand, once, from a git
#   checkout of the same tag (git show v<version>:tests/generation/test_utils.py > DEST/tests/generation/test_utils.py,
#   plus tests/generation/test_framework_agnostic.py if that file imports it). The harness runs the generation mixin
#   only when that file is present and imports against the installed transformers; otherwise this script writes a
#   placeholder module whose GenerationTesterMixin is an empty class marked PLACEHOLDER, the harness reports the
#   generation tests as not run, and test_modeling_common.py (which imports the name) still loads.
# - tests/exporters/test_export.py (ExportTesterMixin, base class of ModelTesterMixin) is not in the sdist either;
#   it gets the same kind of empty placeholder (export tests are not run), unless a real copy is put there.
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

write_placeholder() {  # file, class name, what is not run
    if [ ! -f "$1" ]; then
        cat > "$1" <<EOF
# PLACEHOLDER written by get_transformers_tests.sh: transformers $version's sdist does not ship this file.
# Replace it with the file of tag v$version to run $3.
PLACEHOLDER = True


class $2:
    """Empty stand-in so that test_modeling_common.py imports; no $3 run."""
EOF
    fi
}
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
write_placeholder "$dest/tests/generation/test_utils.py" GenerationTesterMixin "the generation tests"
write_placeholder "$dest/tests/exporters/test_export.py" ExportTesterMixin "the export tests"
echo "$version" > "$dest/TRANSFORMERS_VERSION"
echo "transformers $version tests in $dest/tests; run:"
echo "  HF_PERFORMER_TRANSFORMERS_TESTS=$dest/tests python -m pytest tests/transformers_common"
