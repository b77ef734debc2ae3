"""``fp8conf explain``: a self-contained HTML map of a model's FP8 regions.

The joint graph is drawn as a strip of cells, one per node in graph order, forward pass then
backward pass; a cell takes the colour of the module whose region holds it, incomplete regions
are hatched, and hovering a cell names the node, its op and its region. Below, one table row per
region: module, pass, call, node and FP8-compute counts, complete or why not, and whether
regional compilation compiles it.
"""

from __future__ import annotations

import colorsys
import html

import torch

from fp8contract.writing import check_write_target, write_file
from fp8conf.errors import FileWriteError
from fp8conf.graph.provenance import node_passes
from fp8conf.graph.regions import Region, identify_fp8_regions
from fp8conf.graph.roles import OpRole, op_roles
from fp8conf.graph.trace import trace_info, trace_joint

__all__ = ["render_region_map", "explain_model"]

_STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
.strip{display:flex;flex-wrap:wrap;gap:2px;max-width:1180px}
.c{width:11px;height:15px;border-radius:2px;background:#e4e4e4}
.c.compute{outline:2px solid #111;outline-offset:-2px}
.c.incomplete{background-image:repeating-linear-gradient(45deg,transparent 0 3px,#fff 3px 5px)}
table{border-collapse:collapse;margin-top:8px} td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f4f4f4} .sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:middle;margin-right:6px}
.bad{color:#b00020} .legend span{margin-right:16px;white-space:nowrap;display:inline-block}
"""


def _colours(modules) -> dict[str, str]:
    colours = {}
    for index, fqn in enumerate(modules):
        r, g, b = colorsys.hls_to_rgb((index * 0.618034) % 1.0, 0.55, 0.65)
        colours[fqn] = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
    return colours


def render_region_map(gm: torch.fx.GraphModule, regions: list[Region] | None = None, *, title: str = "FP8 region map") -> str:
    """The HTML page for ``gm`` (regions identified here unless given)."""
    regions = identify_fp8_regions(gm) if regions is None else regions
    info = trace_info(gm)
    modules = list(info.modules) if info else sorted({r.module_fqn for r in regions})
    colours = _colours(modules)
    region_of = {n: r for r in regions for n in r.nodes}
    roles, passes = op_roles(gm.graph), node_passes(gm.graph)
    parts = [f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title><style>{_STYLE}</style>",
             f"<h1>{html.escape(title)}</h1>", _summary(gm, regions, info)]
    for pass_name in ("forward", "backward"):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and passes[n] == pass_name]
        parts.append(f"<h2>{pass_name} pass: {len(nodes)} nodes</h2><div class=strip>")
        parts.extend(_cell(n, region_of.get(n), colours, roles[n]) for n in nodes)
        parts.append("</div>")
    parts.append(_legend(colours))
    parts.append(_table(regions, colours))
    return "".join(parts)


def _summary(gm, regions, info) -> str:
    complete = sum(r.complete for r in regions)
    calls = len(info.calls) if info else "?"
    return (
        f"<p>{len(gm.graph.nodes)} nodes; {len(info.modules) if info else '?'} quantized modules, {calls} calls; "
        f"{len(regions)} FP8 regions, {complete} complete (compiled by regional Inductor), "
        f"<span class={'bad' if complete < len(regions) else ''}>{len(regions) - complete} incomplete (left eager)</span>. "
        "Cells: one per node in graph order, coloured by the module of its region; outlined cells are FP8 matmuls; "
        "hatched cells belong to incomplete regions; grey cells are outside every region.</p>"
    )


def _cell(node, region, colours, role) -> str:
    classes = ["c"] + (["compute"] if role is OpRole.COMPUTE else [])
    style, where = "", "no region"
    if region is not None:
        style = f' style="background-color:{colours.get(region.module_fqn, "#999")}"'
        where = f"region {region.id}" + ("" if region.complete else " (INCOMPLETE)")
        if not region.complete:
            classes.append("incomplete")
    tip = html.escape(f"{node.name}: {node.target} [{role.value}] {where}")
    return f'<div class="{" ".join(classes)}"{style} title="{tip}"></div>'


def _legend(colours) -> str:
    items = "".join(f'<span><i class=sw style="background:{c}"></i>{html.escape(f)}</span>' for f, c in colours.items())
    return f"<h2>Modules</h2><p class=legend>{items}</p>"


def _table(regions, colours) -> str:
    rows = ["<h2>Regions</h2><table><tr><th>region</th><th>module</th><th>pass</th><th>call</th><th>nodes</th>"
            "<th>FP8 matmuls</th><th>complete</th><th>compiled</th></tr>"]
    for r in regions:
        status = "yes" if r.complete else f"<span class=bad>no: {html.escape(r.reason or '')}</span>"
        rows.append(
            f"<tr><td>{html.escape(r.id)}</td><td><i class=sw style='background:{colours.get(r.module_fqn, '#999')}'></i>"
            f"{html.escape(r.module_fqn)}</td><td>{r.pass_name}</td><td>{r.call}</td><td>{len(r.nodes)}</td>"
            f"<td>{len(r.compute_nodes)}</td><td>{status}</td><td>{'regional Inductor' if r.complete else 'eager'}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def explain_model(model: torch.nn.Module, args, path: str) -> list[Region]:
    """Trace ``model(*args)``, write its region map to ``path`` and return the regions.

    ``path`` is checked before tracing, and written whole or not at all; raises
    :class:`~fp8conf.errors.FileWriteError` when it cannot be."""
    check_write_target(path, error=FileWriteError, what="region map")
    gm = trace_joint(model, args)
    regions = identify_fp8_regions(gm)
    page = render_region_map(gm, regions, title=f"FP8 region map of {type(model).__name__}")
    write_file(path, page, error=FileWriteError, what="region map")
    return regions
