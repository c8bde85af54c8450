"""The example scripts' command lines, as a newcomer meets them (issue 45 item 7): every
module of ``torch_impl/examples/`` that runs as ``python -m`` prints its whole docstring and a
sentence for each option on ``--help``, and a distributed example started without torchrun
trains as one process and says how to launch several, instead of torch's error about a
missing ``RANK``."""
import contextlib
import io
import pathlib
import pkgutil
import re
import runpy
import sys
import tempfile

import pytest

import torch_impl.examples as examples
from torch_impl.examples import ddp_mkor, launcher

RUNNABLE = ("ddp_mkor", "fsdp2_train", "torchtitan_configs")
LAUNCHED = ("ddp_mkor", "fsdp2_train")  # distributed: torchrun, else one process


def test_the_runnable_examples_are_every_script_in_the_folder():
    """A module with a ``__main__`` block is listed here (so its help is checked below)."""
    scripts = set()
    for info in pkgutil.iter_modules(examples.__path__):
        source = (examples.__path__[0] + f"/{info.name}.py")
        if 'if __name__ == "__main__":' in open(source).read():
            scripts.add(info.name)
    assert scripts == set(RUNNABLE)


def _help(name, monkeypatch):
    if name == "torchtitan_configs":
        pytest.importorskip("torchtitan")
    out = io.StringIO()
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    # run a fresh copy as __main__, as `python -m` does (runpy warns when the module is in
    # sys.modules already)
    monkeypatch.delitem(sys.modules, f"torch_impl.examples.{name}", raising=False)
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_module(f"torch_impl.examples.{name}", run_name="__main__")
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("name", RUNNABLE)
def test_help_is_whole(name, monkeypatch):
    """``--help`` shows the module's docstring in full (its first line alone was cut
    mid-sentence: "... and a DCP"), names the command it is run by, and gives every option a
    sentence."""
    text = _help(name, monkeypatch)
    module = sys.modules.get(f"torch_impl.examples.{name}") or __import__(
        f"torch_impl.examples.{name}", fromlist=["_"])
    flat = " ".join(text.split())
    assert " ".join(module.__doc__.split()) in flat, "the docstring is not shown in full"
    assert f"-m torch_impl.examples.{name}" in flat
    options = _option_help(text)
    assert "-h" in options and (len(options) > 1 or name == "torchtitan_configs")
    for option, help_text in options.items():
        if option == "-h":  # argparse's own
            continue
        one = " ".join(help_text.split())
        assert one.endswith("."), f"{name} {option}: {one!r}"
        assert one.count("(") == one.count(")"), one


def _option_help(text):
    """{option: its help text} from the options section of ``--help`` (argparse puts the help
    after two spaces, or on the lines below, indented; an option without help has none)."""
    section = text.split("options:\n")[1].split("\n\n")[0]
    options, current = {}, None
    for line in section.splitlines():
        head = re.match(r"^  (-[-\w]+)(?:, --[-\w]+)?(?: \S+)*?(?:  +(\S.*))?$", line)
        if head:
            current = head.group(1)
            options[current] = head.group(2) or ""
        elif current and line.startswith("   "):
            options[current] += " " + line.strip()
    return options


@pytest.mark.parametrize("name", LAUNCHED)
def test_the_distributed_examples_say_how_they_are_launched(name):
    module = __import__(f"torch_impl.examples.{name}", fromlist=["_"])
    assert launcher.launch_command(name) in module.__doc__ or "torchrun --nproc_per_node 2 -m " \
        f"torch_impl.examples.{name}" in module.__doc__
    assert "launcher.start(" in open(module.__file__).read()


def test_the_torchtitan_configs_run_alone_print_how_and_the_configs(monkeypatch, capsys):
    """``python -m torch_impl.examples.torchtitan_configs`` trains nothing itself: run alone,
    without ``--help``, it prints the same help, the torchtitan command and every config."""
    pytest.importorskip("torchtitan")
    monkeypatch.setattr(sys, "argv", ["torchtitan_configs"])
    monkeypatch.delitem(sys.modules, "torch_impl.examples.torchtitan_configs", raising=False)
    runpy.run_module("torch_impl.examples.torchtitan_configs", run_name="__main__")
    out = capsys.readouterr().out
    assert "-m torchtitan.train" in out and "llama3_8b_mkor" in out
    from torch_impl.examples import torchtitan_configs
    assert all(name in out for name in torchtitan_configs.CONFIGS)


def test_ddp_example_without_a_launcher_runs_one_process_and_says_how_to_launch(
        monkeypatch, capsys):
    """Started as ``python -m torch_impl.examples.ddp_mkor`` (no RANK in the environment):
    it trains as one process, rank 0 of 1, prints its result line, tells stderr the torchrun
    command, and leaves no process group and no store file behind."""
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    stores = set(pathlib.Path(tempfile.gettempdir()).glob("ddp_mkor-store-*"))
    result = ddp_mkor.main(["--steps", "3", "--batch", "8", "--width", "8", "--inv-freq", "2"])
    said = capsys.readouterr()
    assert result["factors_identical"] and result["loss"] > 0
    assert "1 rank, 3 steps" in said.out
    assert "no launcher (RANK is not set)" in said.err
    assert "torchrun --nproc_per_node 2 -m torch_impl.examples.ddp_mkor" in said.err
    assert not dist.is_initialized()
    assert set(pathlib.Path(tempfile.gettempdir()).glob("ddp_mkor-store-*")) <= stores
