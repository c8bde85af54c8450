"""Mutants of what a newcomer runs: the README's and the engine page's examples,
``pyproject.toml``, the example scripts (``torch_impl/examples/``), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

README = "README.md"
PYPROJECT = "pyproject.toml"
T_FSDP2_TRAIN = "torch_impl/examples/fsdp2_train.py"
T_DDP = "torch_impl/examples/ddp_mkor.py"
T_LAUNCHER = "torch_impl/examples/launcher.py"
T_TITAN = "torch_impl/examples/torchtitan_configs.py"
CI = ".ci/run"
T_README = "torch_impl/kronecker/README.md"

_R = "theory_tests/project/test_readme.py::"
CPU_STEP = (_R + "test_the_cpu_build_of_torch_is_a_command_before_the_install",)
_P = "theory_tests/project/test_packaging.py::"
EXAMPLE = (_P + "test_shipped_modules_need_only_the_library_and_the_fsdp2_example_says_what_it_needs",)
RUNS_ALONE = (_R + "test_python_examples_run",)
SAYS_ROOT = (_R + "test_a_block_that_needs_the_checkout_says_so",)
SPDX = (_P + "test_pyproject_names_the_license_by_its_spdx_id",)
CI_RUNS = (_R + "test_ci_runs_the_readme_commands",)

MUTANTS = {
    "PORT-NEWCOMER": [
        # The MARS-M block uses torch without importing it (it ran after the MARS block's).
        Mutant(README, "```python\nimport torch\nfrom torch_impl import MARSM, MARS_M, MARS_M_Efficient\n",
               "```python\nfrom torch_impl import MARSM, MARS_M, MARS_M_Efficient\n", tests=RUNS_ALONE),
        # The oracle block no longer says it runs from the clone's root.
        Mutant(README, "MARSReference  # from the clone's root\n", "MARSReference\n",
               tests=SAYS_ROOT + RUNS_ALONE),
        # The CPU step fetches a CUDA build.
        Mutant(README, "--index-url https://download.pytorch.org/whl/cpu\n",
               "--index-url https://download.pytorch.org/whl/cu126\n", tests=CPU_STEP),
        # The CPU step pins a torch the project refuses (the install would swap in the CUDA one).
        Mutant(README, "pip install torch==2.13.0 --index-url", "pip install torch==3.0.0 --index-url",
               tests=CPU_STEP),
        # The payload_bytes block of the MKOR page uses MKOR without importing it.
        Mutant(T_README, "from torch_impl import KFAC, MKOR\n", "from torch_impl import KFAC\n",
               tests=RUNS_ALONE),
        # A missing transformers raises the bare ImportError, without the install command.
        Mutant(T_FSDP2_TRAIN, '        raise ImportError(f"torch_impl.examples.fsdp2_train {NEEDS} ({error})") from error\n',
               "        raise\n", tests=EXAMPLE),
        # The top (and --help, which shows it whole) no longer gives the install command.
        Mutant(T_FSDP2_TRAIN, '''``pip install "transformers>=4.46"``, or the ``examples`` extra''',
               "``pip install transformers``, or the ``examples`` extra", tests=EXAMPLE),
        # transformers imported when the module is (so --help and the message never show).
        Mutant(T_FSDP2_TRAIN, "from torch_impl import KFAC, MARS, MARSM, MKOR\n",
               "from torch_impl import KFAC, MARS, MARSM, MKOR\nfrom transformers import LlamaConfig\n",
               tests=EXAMPLE),
        # The extra the message names brings nothing.
        Mutant(PYPROJECT, 'examples = ["transformers>=4.46"]\n', "examples = []\n", tests=EXAMPLE),
        # The deprecated table form of the license.
        Mutant(PYPROJECT, 'license = "MIT"\n', 'license = { text = "MIT" }\n', tests=SPDX),
        # A build backend too old for PEP 639's license fields.
        Mutant(PYPROJECT, 'requires = ["setuptools>=77", "wheel"]', 'requires = ["setuptools>=68", "wheel"]',
               tests=SPDX),
        # CI installs torch its own way again, not by the README's CPU line (issue 45 item 7)
        Mutant(CI, "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu\n",
               "python -m pip install -q torch==2.13.0\n", tests=CI_RUNS),
    ],
    "TEST-WARNINGS": [
        # a blanket filter: every UserWarning hidden, expected or not
        Mutant(PYPROJECT, '    "ignore:(MKOR|KFAC). nothing is preconditioned, every parameter goes to the backbone:UserWarning",\n',
               '    "ignore::UserWarning",\n'),
        # the library's words from any source hidden
        Mutant(PYPROJECT, '"ignore:(MKOR|KFAC). nothing is preconditioned,', '"ignore:.*nothing is preconditioned,'),
        # a deliberately triggered warning of the library shown again
        Mutant(PYPROJECT, '    "ignore:(MKOR|KFAC). the model already carried the hooks of an earlier (MKOR|KFAC);:UserWarning",\n',
               ""),
    ],
    "EXAMPLES-LAUNCH": [
        # torch's env:// rendezvous without a launcher: the raw error about RANK
        Mutant(T_LAUNCHER, '    if "RANK" in os.environ:\n', "    if True:\n"),
        # one process, silently: nothing says how to launch several
        Mutant(T_LAUNCHER, "          file=sys.stderr, flush=True)\n", "          file=open(os.devnull, \"w\"))\n"),
        # --help cut at the docstring's first line again
        Mutant(T_DDP, "                                description=__doc__,\n",
               "                                description=__doc__.splitlines()[0],\n"),
        Mutant(T_FSDP2_TRAIN, "                                description=__doc__,\n",
               "                                description=__doc__.splitlines()[0],\n"),
        # an option without its sentence
        Mutant(T_DDP, '                   help="Hidden width of the MLP (default 64).")',
               "                   help=None)"),
        # run alone, the configs module prints nothing again
        Mutant(T_TITAN, "    parse().print_help()\n", "    parse()\n"),
    ],
}
