"""The documentation stays true to the code: docs/profiles.md is what memsave.profile_docs generates from
memsave/config.py (so a new profile key without documentation fails here), every preset is in it, every relative
link in README.md and docs/ resolves, and README keeps the install and test commands that CI (.ci/run) runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import memsave
from memsave import profile_docs

ROOT = Path(__file__).resolve().parents[1]
PROFILES_MD = ROOT / "docs" / "profiles.md"
REGENERATE = "python -m memsave.profile_docs > docs/profiles.md"


def test_profiles_md_is_generated_from_config() -> None:
    assert PROFILES_MD.read_text() == profile_docs.render(), (
        f"docs/profiles.md differs from what the profile dataclasses generate; run `{REGENERATE}` and commit it"
    )
    assert profile_docs.main(["--check", str(PROFILES_MD)]) == 0


def test_every_profile_key_is_documented() -> None:
    """Each key has its row in its section, with non-empty help (render() raises without it)."""
    text = PROFILES_MD.read_text()
    for name, cls in profile_docs.sections():
        section = text.split(f"## `[{name}]`\n", 1)[1].split("\n## ", 1)[0]
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help metadata in memsave/config_sections.py"
            assert f"\n| `{f.name}` |" in section, f"docs/profiles.md has no row for {name}.{f.name}"


def test_a_key_without_help_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NewSection:
        """``[new]``: a section someone added."""

        degree: int = 1

    monkeypatch.setattr(profile_docs, "sections", lambda: [("new", NewSection)])
    with pytest.raises(ValueError, match=r"'new\.degree' has no help.*profile_docs"):
        profile_docs.render()


def test_every_preset_is_listed() -> None:
    text = PROFILES_MD.read_text()
    presets = sorted(p.stem for p in (ROOT / "profiles").glob("*.toml"))
    assert presets and presets == memsave.list_presets()
    for name in presets:
        assert f"\n| `{name}` |" in text, f"preset {name} is not listed in docs/profiles.md"
        description = memsave.load_profile(name).description
        assert description, f"preset {name} has no description"


def test_mapping_names_real_keys() -> None:
    """The DeepSpeed / FSDP rows name keys and values that exist (render() checks them) and cover the options
    users bring over most."""
    options = " ".join(row.option for row in (*profile_docs.DEEPSPEED, *profile_docs.FSDP))
    for wanted in ("zero_optimization.stage", "offload_optimizer.device", "offload_param.device", "overlap_comm",
                   "reduce_bucket_size", "stage3_prefetch_bucket_size", "bf16.enabled", "fp16.loss_scale",
                   "initial_scale_power", "hysteresis", "gradient_clipping", "activation checkpointing",
                   "reshard_after_forward", "MixedPrecisionPolicy(param_dtype", "MixedPrecisionPolicy(reduce_dtype",
                   "CPUOffloadPolicy", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        assert wanted in options, f"no mapping row for {wanted}"
    bad = profile_docs.MappingRow("x", ("zero.stages=3",))
    with pytest.raises(ValueError, match="no profile key"):
        profile_docs._mapping_table([bad], "x")
    bad = profile_docs.MappingRow("x", ('precision.compute="fp8"',))
    with pytest.raises(ValueError, match="does not allow"):
        profile_docs._mapping_table([bad], "x")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc: str) -> None:
    path = ROOT / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.is_file(), f"{doc}: link to {target!r}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc}: link to {target!r}: no heading with that anchor"


def test_readme_keeps_the_commands_ci_runs() -> None:
    """.ci/run installs the project the way README says and runs README's test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python -m pytest -q -n 2 --dist loadfile"
    assert f'pip install torch==2.13.0 && pip install -e ".[test]" && {command}\n' in readme
    assert f"```bash\n{command}\n```" in readme
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[test]"' in ci
    # README's test command, perhaps with reporting flags only (-rs: skip reasons in CI's summary)
    assert re.search(r"\npython -m pytest -q -n 2 --dist loadfile( -r\w+)?\n", ci + "\n"), ci
    for doc in ("docs/profiles.md", "docs/benchmarks.md"):
        assert f"]({doc})" in readme, f"README does not link {doc}"
