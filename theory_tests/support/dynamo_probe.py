"""What dynamo did, read from its counters (``torch._dynamo.utils.counters``): the tests of
compiled models assert where the graph broke and how many graphs were compiled."""
import re

import torch
import torch._dynamo

__all__ = ["compiled_graphs", "disabled_calls"]


def compiled_graphs():
    """Graphs dynamo compiled since its counters were last cleared."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def disabled_calls():
    """Names (``Class.method``) of the ``torch.compiler.disable``d functions dynamo broke its
    graph at since its counters were last cleared."""
    names = set()
    for reason in torch._dynamo.utils.counters["graph_break"]:
        match = re.search(r"Skip calling function `<function (\S+) at", reason)
        if match:
            names.add(match.group(1))
    return names
