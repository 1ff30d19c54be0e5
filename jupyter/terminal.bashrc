# The shell of JupyterLab's terminals under `make lab` / `make instructor`: the user's usual settings,
# then the project's environment, in the repository root (so `pytest labs/NN_name` just works).
[ -f ~/.bashrc ] && . ~/.bashrc
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$repo/.venv/bin/activate"
cd "$repo"
echo "inference-labs: grade a lab with 'pytest labs/NN_name' (e.g. pytest labs/00_warmup)"
