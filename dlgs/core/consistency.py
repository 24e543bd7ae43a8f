"""Cross-rank agreement checks (pure functions over gathered descriptions).

Horovod negotiates collectives by name: if one rank's model has a layer the
others lack, the others wait for it forever (Horovod only prints stall
warnings). dlgs therefore gathers a description of every rank's layers and
options once, at construction, and every rank raises the same error if they
differ.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["signature", "describe_mismatch", "RankMismatchError"]


class RankMismatchError(ValueError):
    """Ranks were given different models or options."""


def signature(
    layers: Sequence[Tuple[str, Sequence[int], str]], options: Dict[str, Any]
) -> Dict[str, Any]:
    """A plain-Python, picklable description of one rank's setup.

    Args:
        layers: ``(name, shape, dtype)`` of every exchanged parameter.
        options: the sparsification options (``SparsityConfig.to_dict()``) and
            anything else every rank must agree on.
    """
    return {
        "layers": [(str(n), tuple(int(s) for s in shape), str(dt)) for n, shape, dt in layers],
        "options": dict(options),
    }


def describe_mismatch(signatures: Sequence[Dict[str, Any]]) -> Optional[str]:
    """``None`` if all ranks' signatures agree, else a readable explanation
    naming the first differing ranks, parameters and options."""
    ref = signatures[0]
    problems: List[str] = []
    ref_layers = {n: (s, d) for n, s, d in ref["layers"]}
    for rank, sig in enumerate(signatures[1:], start=1):
        if sig == ref:
            continue
        layers = {n: (s, d) for n, s, d in sig["layers"]}
        only_ref = sorted(set(ref_layers) - set(layers))
        only_here = sorted(set(layers) - set(ref_layers))
        if only_ref:
            problems.append(f"rank {rank} lacks parameters {only_ref[:5]} that rank 0 has")
        if only_here:
            problems.append(f"rank {rank} has parameters {only_here[:5]} that rank 0 lacks")
        for name in sorted(set(layers) & set(ref_layers)):
            if layers[name] != ref_layers[name]:
                problems.append(
                    f"parameter {name!r}: shape/dtype {ref_layers[name]} on rank 0, "
                    f"{layers[name]} on rank {rank}"
                )
                break
        if not (only_ref or only_here) and [n for n, _, _ in sig["layers"]] != [
            n for n, _, _ in ref["layers"]
        ]:
            problems.append(f"rank {rank} orders its parameters differently from rank 0")
        for key in sorted(set(ref["options"]) | set(sig["options"])):
            a, b = ref["options"].get(key), sig["options"].get(key)
            if a != b:
                problems.append(f"option {key}={b!r} on rank {rank} but {a!r} on rank 0")
        if len(problems) >= 5:
            break
    if not problems:
        return None
    return "ranks disagree on the model or dlgs options: " + "; ".join(problems)
