"""`--lora-modules`: vLLM's two spellings of the adapters a server loads at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """`name=path` or a JSON object `{"name", "path", "base_model_name"}` per value; ValueError
    naming --lora-modules for anything else or a name given twice."""
    modules: list[LoRAModule] = []
    for value in values or ():
        text = value.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({e.msg})") from None
            unknown = set(obj) - {"name", "path", "base_model_name"} if isinstance(obj, dict) else set()
            if not isinstance(obj, dict) or unknown or not all(isinstance(obj.get(k), str) and obj.get(k)
                                                               for k in ("name", "path")):
                raise ValueError(f"--lora-modules: {value!r} must be a JSON object with string 'name' and 'path' "
                                 "(and optionally 'base_model_name')")
            module = LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} must be name=path or a JSON object")
            module = LoRAModule(name, path)
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        modules.append(module)
    return tuple(modules)
