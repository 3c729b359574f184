"""The hooks of every role, declared once (fedflat/core/hooks.py): the part bases define exactly them, the contract's
debug mode watches every one, and docs/extending.md's tables are made from the same table."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from fedflat.core import Aggregation, Correction, Filter, Part, Personalization, Perturbation, ServerUpdate
from fedflat.core.contract import HOOKS as WATCHED
from fedflat.core.hooks import HOOKS, PART_TABLE, ROLE_HOOKS, STAGE_TABLE, hook_table
from fedflat.core.upload import UploadStage

BASES = {"any": Part, "perturbation": Perturbation, "filter": Filter, "correction": Correction,
         "aggregation": Aggregation, "server": ServerUpdate, "personalization": Personalization, "upload": UploadStage}
EXTENDING = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.mark.parametrize("role", sorted(BASES))
def test_each_role_base_defines_exactly_the_hooks_of_its_row(role):
    base = BASES[role]
    defined = {name for name, value in vars(base).items()
               if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod))}
    assert defined == set(ROLE_HOOKS[role])


def test_the_signatures_in_the_table_are_the_bases():
    for hook in HOOKS:
        if hook.role == "attack":
            continue
        params = list(inspect.signature(getattr(BASES[hook.role], hook.name)).parameters)[1:]  # without self
        assert hook.call == f"{hook.name}({', '.join(params)})"


def test_every_attack_defines_poison():
    from fedflat.algorithms import attacks
    from fedflat.core import STAGES

    poisoners = [cls for cls in STAGES.values() if cls.__module__ == attacks.__name__ and "poison" in dir(cls)]
    assert poisoners and all(issubclass(cls, attacks.DataAttack) for cls in poisoners)
    assert ROLE_HOOKS["attack"] == ("poison",) and "poison" in vars(attacks.DataAttack)


def test_the_contract_watches_every_hook():
    assert WATCHED == {h.name for h in HOOKS}


def test_the_docs_tables_are_the_core_table():
    """docs/extending.md holds both tables exactly as fedflat.core.hook_table renders them: a hook added, renamed or
    described differently in one place and not the other fails here (regenerate with hook_table)."""
    text = EXTENDING.read_text()
    for roles in (PART_TABLE, STAGE_TABLE):
        table = hook_table(roles)
        assert table in text, f"docs/extending.md's table of {roles} is not fedflat.core.hook_table({roles})"
    assert set(PART_TABLE) | set(STAGE_TABLE) == set(ROLE_HOOKS)


def _users(hook: str) -> set[str]:
    """The registered parts and stages (``role:name``) whose class defines ``hook`` itself or inherits it from a
    method's class, not from fedflat.core's base."""
    import fedflat.algorithms  # noqa: F401 - registers every built-in part and stage
    from fedflat.core import PARTS, STAGES

    users = set()
    for cls in [*(c for parts in PARTS.values() for c in parts.values()), *STAGES.values()]:
        owner = next((k for k in cls.__mro__ if hook in vars(k)), None)
        if owner is not None and owner.__module__.startswith("fedflat.algorithms"):
            users.add(f"{cls.role}:{cls.name}")
    return users


def test_every_hook_with_at_most_one_user_says_why_it_is_a_hook():
    """Issue 46: a hook that serves one part either serves a second or says, in docs/architecture.md's "Hooks with one
    user", why it stays; a hook that gains or loses users fails here until that list is updated."""
    section = ARCHITECTURE.read_text().split("## Hooks with one user")[1].split("\n## ")[0]
    documented = {hook: set() if users == "none" else set(users.split(", "))
                  for hook, users in re.findall(r"^- `(\w+)` \(([\w:, ]+)\) — ", section, flags=re.M)}
    at_most_one = {h.name: _users(h.name) for h in HOOKS if len(_users(h.name)) <= 1}
    assert documented == at_most_one
    assert {"personal", "private_buffers", "initialize"} <= set(documented)
