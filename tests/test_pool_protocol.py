"""The pools and the schedule have every member the Protocols the driver types them by name, with the same
parameters: a member renamed on one side fails here, not on a cluster (no Ray needed: classes are read, not built)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from raydl.cluster.elastic import ElasticSchedule
from raydl.cluster.pool import WorkerPool
from raydl.cluster.pool_protocol import DriverPool, ResizablePool
from raydl.driver.schedule import Schedule
from raydl.job.pool import JobPool


def _protocol_members(protocol: type) -> dict:
    """{name: the Protocol's attribute or method} over the Protocol and the Protocols it extends."""
    members: dict = {}
    for base in reversed(protocol.__mro__):
        if not getattr(base, "_is_protocol", False) or base is object or base.__module__ == "typing":
            continue
        members.update({name: None for name in base.__dict__.get("__annotations__", {})})
        members.update(
            {
                name: value
                for name, value in vars(base).items()
                if not name.startswith("_") and isinstance(value, (property, type(lambda: None)))
            }
        )
    return members


def _instance_attributes(cls: type) -> set:
    """Names its methods assign as `self.<name>` (in a tuple target too), over the class and its bases."""
    names: set = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        names.add(leaf.attr)
    return names


def _parameters(fn) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _mismatches(cls: type, protocol: type) -> list:
    """What `cls` lacks of `protocol`, or has with other parameters; empty when it conforms."""
    assigned = _instance_attributes(cls)
    found = []
    for name, member in _protocol_members(protocol).items():
        own = inspect.getattr_static(cls, name, None)
        if member is None or isinstance(member, property):  # a data member: a class attribute or set on self
            if own is None and name not in assigned:
                found.append(f"{name}: missing")
            elif own is not None and callable(own) and not isinstance(own, property):
                found.append(f"{name}: a method, not a value")
            continue
        if own is None or not callable(own) or isinstance(own, property):
            found.append(f"{name}: no such method")
        elif _parameters(own) != _parameters(member):
            found.append(f"{name}: parameters {_parameters(own)} != {_parameters(member)}")
    return found


@pytest.mark.parametrize(
    ("cls", "protocol"),
    [(WorkerPool, ResizablePool), (JobPool, DriverPool), (Schedule, ElasticSchedule)],
    ids=["WorkerPool", "JobPool", "Schedule"],
)
def test_class_has_every_member_of_its_protocol(cls, protocol):
    """Each pool has every member the driver types it by (a private pool the resizable ones too), and the schedule
    what resizing uses of it, each method with the Protocol's parameters."""
    assert _mismatches(cls, protocol) == []


def test_resizable_pool_extends_driver_pool():
    """What a private pool adds comes on top of every member of `DriverPool`."""
    assert set(_protocol_members(DriverPool)) < set(_protocol_members(ResizablePool))
    assert {"actors", "records", "node_of", "describe", "shutdown"} <= set(_protocol_members(DriverPool))


def test_a_drifted_class_is_caught():
    """A class missing a value, naming a method's parameter otherwise or lacking a method fails the check."""

    class Drifted:
        active: list = []

        def __init__(self) -> None:
            self.workers_num_tasks = []

        def add_worker(self, wid: int) -> None: ...

        def remove_worker(self, worker_id: int, lost: bool = False) -> None: ...

    found = _mismatches(Drifted, ElasticSchedule)
    assert any(f.startswith("max_tasks: missing") for f in found)
    assert any(f.startswith("add_worker: parameters") for f in found)
    assert "reassign: no such method" in found
    assert not any(f.startswith(("active", "workers_num_tasks", "remove_worker")) for f in found)
