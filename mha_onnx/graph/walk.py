"""The one walk over an ONNX file's graphs: a node's subgraphs (If branches, Loop and Scan
bodies, at any depth), every graph, every node. (On onnx-ir the rewrite walks with onnx-ir's
``RecursiveGraphIterator`` and ``rewrite/blocks.all_graphs``.)"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
from onnx import helper


def attr(node: onnx.NodeProto, name: str, default=None):
    """A node's attribute ``name`` as a Python value (int, float, list, tensor, graph), or
    ``default`` when the node does not carry it."""
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds as attributes (``GRAPH`` and ``GRAPHS``), in order."""
    return [sub for attr in node.attribute
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))]


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph below it, each before its own subgraphs."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs, a node before the nodes it holds."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from all_nodes(sub)
