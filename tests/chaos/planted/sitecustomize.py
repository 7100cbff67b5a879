"""Defects planted in the `smoltorrent` CLI of one fault run (tests/chaos/test_planted.py
puts this directory on the CLI's PYTHONPATH only), one per kind of lie the checker must
catch:

- run/best.safetensors is gathered at the version before its current (a stale read);
- eval/model.safetensors is gathered as run/latest.safetensors (a read across names);
- client 2's stores of run/latest.safetensors (their sources are named c2-...) say they
  stored (exit 0, a version key) and store nothing (an acknowledgement lost);
- an `rm` of a scratch name says it removed (exit 0) and removes nothing (a removed name
  still served);
- a waited store of eval/model.safetensors stores, then exits 1 (a failure reported for
  a store that committed).

Each is patched into its module once that module is imported (an import hook), so
nothing here runs in a process that does not import it.
"""

import importlib.abc
import json
import os
import sys


def _plant_versions(module) -> None:
    resolve = module.Versions.resolve

    def planted(self, name, version=None):
        if version is None and name == "eval/model.safetensors":
            return resolve(self, "run/latest.safetensors")
        current = resolve(self, name, version)
        if version is None and name == "run/best.safetensors":
            committed = [v for v in self.versions(name) if self.version(v)["state"] == "committed"]
            if current in committed and committed.index(current) > 0:
                return committed[committed.index(current) - 1]
        return current

    module.Versions.resolve = planted


def _plant_store(module) -> None:
    store = module.cmd_store

    def planted(args):
        if args.name == "run/latest.safetensors" and os.path.basename(args.path).startswith("c2-"):
            print(json.dumps({"vkey": "0" * 32, "name": args.name}))
            return 0
        code = store(args)
        if args.name == "eval/model.safetensors" and not args.no_wait:
            return 1
        return code

    module.cmd_store = planted


def _plant_remove(module) -> None:
    remove = module.cmd_rm

    def planted(args):
        if args.name.startswith("scratch/"):
            print("[]")
            return 0
        return remove(args)

    module.cmd_rm = planted


PLANTS = {
    "coordinator.cli.operation_commands": _plant_remove,
    "coordinator.state.versions": _plant_versions,
    "coordinator.cli.transfer_commands": _plant_store,
}


class _Planter(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in PLANTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def planted_exec(module):
            exec_module(module)
            PLANTS[fullname](module)

        spec.loader.exec_module = planted_exec
        return spec


sys.meta_path.insert(0, _Planter())
