"""Profiles: presets load and round-trip, overrides apply, bad input is refused with a message that names the
key, the value and what is allowed; ``memsave.wrap`` refuses what is not built yet and objects it cannot use."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from memsave.config import PRESET_DIR, Profile, list_presets, load_profile
from tests.harness import run_ranks


# -- presets ---------------------------------------------------------------------------------------------------
def test_presets_are_listed() -> None:
    presets = list_presets()
    assert {"ddp", "zero1", "zero2", "zero3"} <= set(presets)
    assert presets == sorted(presets)


@pytest.mark.parametrize("name", list_presets())
def test_preset_loads_by_name_and_path_and_round_trips(name: str) -> None:
    by_name = load_profile(name)
    path = PRESET_DIR / f"{name}.toml"
    assert load_profile(path) == by_name
    assert load_profile(str(path)) == by_name
    assert Profile.load(name) == by_name
    assert by_name.name == name and by_name.description, "a preset says what it trades in `description`"
    assert Profile.from_dict(by_name.to_dict()) == by_name
    assert load_profile(by_name) is by_name
    if name in ("ddp", "zero1", "zero2", "zero3"):
        assert by_name.zero.stage == (0 if name == "ddp" else int(name[-1]))
    if name.endswith("-adafactor"):
        assert by_name.optimizer.name == "adafactor" and by_name.zero.stage == int(name[4])


def test_adafactor_profile_builds_memsave_adafactor() -> None:
    from memsave.optim import Adafactor, build_optimizer

    cfg = load_profile("zero3-adafactor", ["optimizer.beta1=0.9", 'optimizer.momentum_dtype="bf16"']).optimizer
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = build_optimizer([p], cfg)
    assert isinstance(opt, Adafactor)
    group = opt.param_groups[0]
    assert (group["lr"], group["relative_step"], group["beta1"], group["momentum_dtype"]) == (
        cfg.lr, False, 0.9, torch.bfloat16)


def test_a_copied_preset_loads_from_any_path(tmp_path: Path) -> None:
    copy = tmp_path / "mine.toml"
    copy.write_text((PRESET_DIR / "zero3.toml").read_text() + "\n[optimizer]\nbetas = [0.8, 0.9]\n")
    profile = load_profile(copy)
    assert profile.name == "mine" and profile.zero.stage == 3 and profile.optimizer.betas == (0.8, 0.9)
    assert Profile.from_dict(profile.to_dict()) == profile


# -- overrides -------------------------------------------------------------------------------------------------
def test_overrides_apply() -> None:
    p = load_profile("zero3", ["zero.stage=2", "--zero.bucket_mb=4", "precision.loss_scale=1024"])
    assert p.zero.stage == 2 and isinstance(p.zero.stage, int)
    assert p.zero.bucket_mb == 4.0 and isinstance(p.zero.bucket_mb, float)
    assert p.precision.loss_scale == 1024.0
    assert p.zero.prefetch == 1 and p.name == "zero3"  # the rest of the preset stays
    assert Profile.from_dict(p.to_dict()) == p
    p = load_profile("ddp", ['precision.loss_scale="dynamic"', 'recompute.policy="every:2"',
                             "optimizer.betas=[0.8, 0.99]", "zero.reshard_after_forward=false", "offload.fraction=0.5"])
    assert p.precision.loss_scale == "dynamic" and p.recompute.policy == "every:2"
    assert p.optimizer.betas == (0.8, 0.99) and p.zero.reshard_after_forward is False and p.offload.fraction == 0.5
    # on a profile built in code
    q = Profile.load(Profile(), ["zero.stage=1"])
    assert q.zero.stage == 1 and q.name == "custom"


def test_offload_chunk_auto_is_64_mib_for_the_host_step_on_cuda_only() -> None:
    """``[offload] chunk_mb = "auto"`` (the default): 64 MiB where the step runs on the host behind a GPU (pinned
    host slots; 1 MiB chunks made a 110M-parameter bf16 optimizer step 5-7x slower on an H100), 1 MiB where a CPU
    device streams its state through a window or the state goes to the device; a number is taken as given."""
    from memsave.config import OffloadConfig

    host = OffloadConfig(optimizer="cpu")
    assert host.chunk_mb == "auto" and OffloadConfig(optimizer="cpu", chunk_mb=4).chunk_bytes("cuda", mixed=True) == 4 * 2**20
    assert host.chunk_bytes("cuda", mixed=True) == 64 * 2**20 and host.chunk_bytes("cpu", mixed=True) == 2**20
    assert OffloadConfig(optimizer="cpu", step="device").chunk_bytes("cuda", mixed=True) == 2**20
    assert OffloadConfig(optimizer="disk", path="/tmp").chunk_bytes("cpu", mixed=False) == 2**20
    assert load_profile("zero3", ['offload.optimizer="cpu"', 'offload.chunk_mb="auto"']).offload.chunk_mb == "auto"


# -- bad input -------------------------------------------------------------------------------------------------
BAD_OVERRIDES = [
    # (overrides, fragments the message must contain: the key, the value, what is allowed)
    (["bogus.stage=1"], ["'bogus'", "bogus.stage=1", "zero", "precision", "offload", "recompute", "optimizer"]),
    (["zero.stages=1"], ["zero.stages", "stage", "bucket_mb", "prefetch"]),
    (["zero.stage='2'"], ["zero.stage", "'2'", "integer"]),  # a string for an int
    (["zero.stage=two"], ["zero.stage", "'two'", "integer"]),
    (["zero.stage=true"], ["zero.stage", "True", "integer"]),  # a bool for an int
    (["zero.stage=2.0"], ["zero.stage", "2.0", "integer"]),  # a float for an int
    (["zero.bucket_mb=true"], ["zero.bucket_mb", "True", "number"]),
    (["zero.reshard_after_forward=1"], ["zero.reshard_after_forward", "1", "true or false"]),
    (["zero.stage=5"], ["zero.stage", "5", "0", "1, 2 or 3"]),
    (["zero.bucket_mb=0"], ["zero.bucket_mb", "0", "positive"]),
    (["offload.fraction=2"], ["offload.fraction", "2", "0 to 1"]),
    (["offload.chunk_mb=0"], ["offload.chunk_mb", "0", "positive size in MiB", '"auto"']),
    (['offload.chunk_mb="big"'], ["offload.chunk_mb", "'big'", "a number or 'auto'"]),
    (['offload.optimizer="gpu"'], ["offload.optimizer", "'gpu'", "'none'", "'cpu'", "'disk'"]),
    (['offload.optimizer="disk"'], ["offload.path", "''", "folder"]),
    (['recompute.policy="sometimes"'], ["recompute.policy", "'sometimes'", "none", "full", "every:K", "selective"]),
    (['recompute.compress="int4"'], ["recompute.compress", "'int4'", "'none'", "'bf16'", "'fp8'"]),
    (['precision.compute="fp8"'], ["precision.compute", "'fp8'", "'bf16'", "'fp16'"]),
    (["precision.loss_scale=-1"], ["precision.loss_scale", "-1", "positive"]),
    (["optimizer.betas=[0.9]"], ["optimizer.betas", "[0.9]", "2 values"]),
    (["optimizer.betas=[0.9, 1.5]"], ["optimizer.betas", "1.5", "[0, 1)"]),
    (['optimizer.name="lamb"'], ["optimizer.name", "'lamb'", "'adamw'", "'sgd'"]),
    (['optimizer.name="adafactor"', "optimizer.decay_rate=0.8"], ["optimizer.decay_rate", "0.8", "[-1, 0)"]),
    (['optimizer.name="adafactor"', "optimizer.clip_threshold=0"], ["optimizer.clip_threshold", "0", "> 0"]),
    (['optimizer.name="adafactor"', "optimizer.beta1=1"], ["optimizer.beta1", "1", "[0, 1)"]),
    (['optimizer.name="adafactor"', 'optimizer.momentum_dtype="bf16"'], ["optimizer.momentum_dtype", "'bf16'",
                                                                         "beta1 = 0"]),
    (["optimizer.beta1=0.9"], ["optimizer.beta1", "0.9", "adafactor", "'adamw'"]),  # an Adafactor key for AdamW
    (["zero.stage"], ["'zero.stage'", "section.key=value"]),  # no "="
    (["stage=1"], ["'stage=1'", "section.key=value"]),  # no section
    (['zero.stage=2', 'offload.params="cpu"'], ["offload.params", "'cpu'", "zero.stage = 3", "got 2"]),
    (["parallel.tp=0"], ["'parallel.tp'", "0", "positive integer"]),
    (["parallel.pp=-1"], ["'parallel.pp'", "-1", "positive integer"]),
    (["parallel.tp=true"], ["'parallel.tp'", "True", "integer"]),
    (["parallel.tp=2.0"], ["'parallel.tp'", "2.0", "integer"]),
    (['parallel.pp="2"'], ["'parallel.pp'", "'2'", "integer"]),
    (["parallel.dp=2"], ["'parallel.dp'", "tp", "pp"]),
]


@pytest.mark.parametrize(("overrides", "fragments"), BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_override_is_refused_naming_key_value_and_allowed(overrides: list[str], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        load_profile("ddp", overrides)
    message = str(err.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


BAD_TOML = [
    ("[zero]\nstage = 1\n[zeroo]\nstage = 2\n", ["'zeroo'", "zero", "precision", "optimizer"]),
    ("[zero]\nstagee = 1\n", ["zero.stagee", "stage", "bucket_mb"]),
    ('[zero]\nstage = "1"\n', ["zero.stage", "'1'", "integer"]),
    ("[zero]\nstage = true\n", ["zero.stage", "True", "integer"]),
    ("[zero]\nstage = 1.0\n", ["zero.stage", "1.0", "integer"]),
    ("zero = 3\n", ["'zero'", "3", "[zero] table"]),
    ("name = 3\n", ["'name'", "3", "string"]),
    ("[optimizer]\nbetas = [0.9]\n", ["optimizer.betas", "[0.9]", "2 values"]),
    ('[zero]\nstage = 2\n[offload]\nparams = "cpu"\n', ["offload.params", "'cpu'", "zero.stage = 3"]),
    ("[zero\nstage = 1\n", ["not valid TOML", "bad.toml"]),
]


@pytest.mark.parametrize(("text", "fragments"), BAD_TOML, ids=[t.splitlines()[-1] for t, _ in BAD_TOML])
def test_bad_file_is_refused(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_profile(path)
    missing = [f for f in fragments if f not in str(err.value)]
    assert not missing, f"message {str(err.value)!r} lacks {missing}"


def test_missing_file_and_unknown_preset(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "profile.toml"
    with pytest.raises(ValueError, match=re.escape(f"profile file '{missing}' does not exist")):
        load_profile(missing)
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(str(missing))
    with pytest.raises(ValueError) as err:
        load_profile("zero9")
    assert "'zero9'" in str(err.value)
    assert all(name in str(err.value) for name in list_presets()), f"{err.value} should list the presets"


@pytest.mark.parametrize("kwargs", [{"stage": True}, {"stage": 2.0}, {"prefetch": 1.5},
                                    {"reshard_after_forward": "no"}], ids=str)
def test_sections_built_in_code_check_types(kwargs: dict) -> None:
    from memsave.config import ZeroConfig

    key, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=re.escape(f"'zero.{key}' = {value!r}")):
        ZeroConfig(**kwargs)


def test_offload_params_needs_stage_3() -> None:
    from memsave.config import OffloadConfig, ZeroConfig

    with pytest.raises(ValueError, match=r"offload.params.*'cpu'.*zero.stage = 3"):
        Profile(zero=ZeroConfig(stage=2), offload=OffloadConfig(params="cpu"))
    assert Profile(zero=ZeroConfig(stage=3), offload=OffloadConfig(params="cpu")).offload.params == "cpu"
    assert load_profile("zero3", ['offload.params="cpu"']).offload.params == "cpu"


# -- memsave.wrap: what it refuses -----------------------------------------------------------------------------
NOT_IMPLEMENTED = {
    "fp16 reduce under bf16": ['precision.compute="bf16"', 'precision.reduce="fp16"'],
    "bf16 reduce under fp32": ['precision.reduce="bf16"'],
    "offload optimizer": ['offload.optimizer="cpu"'],
    "offload params": ["zero.stage=3", 'offload.path="memsave-offload"', 'offload.params="disk"'],
    # each works alone (tests/test_activation_memory.py); together one set of saved-tensor hooks would hide the other
    "offload activations with compress": ['offload.activations="cpu"', 'recompute.compress="bf16"'],
}
NOT_AN_OPTIMIZER = ("a string", "the optimizer class", "a list of parameters", "None")


def _outcome(fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[str, str]:
    """``(exception type name, message)`` of ``fn(*args, **kwargs)``, or ``("no error", "")``."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def _num_hooks(model: object) -> int:
    """Post-accumulate-grad hooks on the model's parameters (what an engine installs)."""
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())  # type: ignore[attr-defined]


def _wrap_refusals() -> dict:
    import copy

    import torch

    import memsave
    from tests.toy import ToyLM

    mesh = memsave.init()
    wrap = memsave.wrap
    out: dict = {}
    base = ToyLM()

    for case, overrides in NOT_IMPLEMENTED.items():
        m = copy.deepcopy(base)
        out["notimpl", case] = _outcome(wrap, m, torch.optim.AdamW(m.parameters()), load_profile("ddp", overrides),
                                        mesh=mesh)
        out["untouched", case] = type(m) is ToyLM and _num_hooks(m) == 0
    # recompute works through wrap (tests/test_recompute.py); budget:<size> needs a batch to measure
    for stage in ("ddp", "zero3"):
        m = copy.deepcopy(base)
        profile = load_profile(stage, ['recompute.policy="budget:1MiB"'])
        out["budget without inputs", stage] = _outcome(wrap, m, torch.optim.AdamW(m.parameters()), profile, mesh=mesh)
        out["budget untouched", stage] = type(m) is ToyLM and _num_hooks(m) == 0 and "forward" not in m.blocks[0].__dict__
    for stage in ("ddp", "zero1", "zero3"):
        bad = {
            "a string": "adamw",
            "the optimizer class": torch.optim.AdamW,
            "a list of parameters": list(base.parameters()),
            "None": None,
        }
        for case, obj in bad.items():
            out["not optimizer", case, stage] = _outcome(wrap, copy.deepcopy(base), obj, stage, mesh=mesh)
        m = copy.deepcopy(base)
        foreign = torch.optim.AdamW([*m.parameters(), torch.zeros(3, requires_grad=True)])
        out["foreign", stage] = _outcome(wrap, m, foreign, stage, mesh=mesh)
        other = torch.optim.AdamW(base.parameters())
        out["other model", stage] = _outcome(wrap, copy.deepcopy(base), other, stage, mesh=mesh)
        with torch.device("meta"):
            meta = ToyLM()
        out["meta", stage] = _outcome(wrap, meta, torch.optim.AdamW(meta.parameters()), stage, mesh=mesh)
        out["not a module", stage] = _outcome(wrap, print, other, stage, mesh=mesh)
        # wrapping twice: again with the same optimizer, with the wrapped one, with a new one
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters())
        wm, wopt = wrap(m, opt, stage, mesh=mesh)
        hooks = _num_hooks(wm)
        out["twice same", stage] = _outcome(wrap, wm, opt, stage, mesh=mesh)
        out["twice wrapped", stage] = _outcome(wrap, wm, wopt, "ddp", mesh=mesh)
        out["twice new", stage] = _outcome(wrap, wm, torch.optim.AdamW(wm.parameters()), stage, mesh=mesh)
        out["hooks after refused wraps", stage] = (hooks, _num_hooks(wm))
        # and the first wrap still trains after the refusals
        batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long)}
        wopt.backward(wm(**batch).loss)
        wopt.step()
        wopt.zero_grad()
        out["still trains", stage] = bool(torch.isfinite(wm(**batch).loss))
    return out


@pytest.fixture(scope="module")
def refusals() -> dict:
    """Every ``memsave.wrap`` refusal, tried once in one spawned process (world of one)."""
    return run_ranks(_wrap_refusals, 1, timeout=120)[0]


@pytest.mark.parametrize("case", list(NOT_IMPLEMENTED))
def test_wrap_refuses_techniques_not_built_yet(refusals: dict, case: str) -> None:
    kind, message = refusals["notimpl", case]
    assert kind == "NotImplementedError", (kind, message)
    assert "not implemented" in message
    setting = NOT_IMPLEMENTED[case][-1].split("=")[0].split(".")[0]  # the section it names
    assert f"[{setting}]" in message, message
    assert refusals["untouched", case], "a refused wrap must leave the model as it was"


@pytest.mark.parametrize("stage", ["ddp", "zero3"])
def test_wrap_recompute_budget_needs_example_inputs(refusals: dict, stage: str) -> None:
    kind, message = refusals["budget without inputs", stage]
    assert kind == "ValueError", (kind, message)
    assert "[recompute] policy='budget:1MiB'" in message and "example_inputs=" in message, message
    assert refusals["budget untouched", stage], "a refused wrap must leave the model as it was"


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero3"])
def test_wrap_refuses_bad_objects(refusals: dict, stage: str) -> None:
    kind, message = refusals["foreign", stage]
    assert kind == "ValueError" and "not a parameter of the model" in message and "(3,)" in message, message
    kind, message = refusals["other model", stage]
    assert kind == "ValueError" and "not a parameter of the model" in message, message
    # a model on the meta device is materialized by wrap (tests/test_deferred.py); ToyLM's buffer 'scale' was computed
    # in __init__ under plain torch.device("meta"), so it has no value and nothing initializes it: refused, named
    kind, message = refusals["meta", stage]
    assert kind == "ValueError" and "meta device" in message and "buffer 'scale'" in message, message
    kind, message = refusals["not a module", stage]
    assert kind == "ValueError" and "torch.nn.Module" in message and "builtin_function" in message, message


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero3"])
def test_wrap_refuses_wrapping_twice(refusals: dict, stage: str) -> None:
    for case in ("twice same", "twice wrapped", "twice new"):
        kind, message = refusals[case, stage]
        assert kind == "ValueError", (case, kind, message)
    kind, message = refusals["twice new", stage]
    assert "already wrapped" in message and "once" in message, message
    assert refusals["still trains", stage]


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero3"])
def test_refused_second_wrap_leaves_no_hooks_behind(refusals: dict, stage: str) -> None:
    before, after = refusals["hooks after refused wraps", stage]
    assert after == before, f"{after - before} hooks left on the parameters by refused wraps"


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero3"])
def test_wrap_refuses_a_non_optimizer_with_value_error(refusals: dict, stage: str) -> None:
    for case in NOT_AN_OPTIMIZER:
        kind, message = refusals["not optimizer", case, stage]
        assert kind == "ValueError" and "torch.optim.Optimizer" in message, (case, kind, message)


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero3"])
def test_wrap_refuses_a_non_optimizer(refusals: dict, stage: str) -> None:
    """wrap refuses a bad optimizer object before going on with it."""
    for case in NOT_AN_OPTIMIZER:
        kind, message = refusals["not optimizer", case, stage]
        assert kind == "ValueError", (case, kind, message)
