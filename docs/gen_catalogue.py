"""Write docs/catalogue.md from the mechanism registry.

python docs/gen_catalogue.py          # rewrite the page
python docs/gen_catalogue.py --check  # exit 1 if the page is stale

The rows (model, quantities, citation, paper check) come from
`structinfer.testing.registry`; the four columns of Singh & Buckley Table 1 (Graph,
Prior, Potentials, Value), the one-line description and the code excerpt come from each
model's docstring (Markdown with `$...$` math) and source. The page is laid out for a
laptop screen: a compact index table (name, description, paper section) and then one
section per mechanism, grouped by paper, with its equations as paragraphs rather than
table cells, so that nothing is cut off. Everything that turns the registry into
Markdown lives here.
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

from structinfer.testing.registry import REGISTRY, Mechanism, Quantity

PAGE = pathlib.Path(__file__).resolve().parent / "catalogue.md"

#: how the page cites each paper key of the registry (`Mechanism.paper`)
PAPERS = {
    "SB": "Singh & Buckley, *Attention as implicit structural inference*",
    "T": "Tschantz, *Attention via log-sum-exp energy* (v1, v2, slides)",
    "M": "McCarter, *Inverse distance weighting attention*",
}
#: the short form of each paper in the index table
AUTHORS = {"SB": "Singh & Buckley", "T": "Tschantz", "M": "McCarter"}

_SECTIONS = ("Graph", "Prior", "Potentials", "Value")


def citation(row: Mechanism) -> str:
    """The paper and section a row cites, as Markdown."""
    if row.paper not in PAPERS:
        raise KeyError(
            f"row '{row.name}' cites paper {row.paper!r}; add it to PAPERS in docs/gen_catalogue.py"
        )
    return f"{PAPERS[row.paper]}, {row.section}"


def describe(q: Quantity) -> str:
    """A quantity in words, as Markdown."""
    t = q.target
    return {
        "attention": f"attention `p({t} | x)`",
        "output": f"output `E[{t}]`",
        "energy": "energy `-log p(x)`",
        "neg_grad": f"`-dE/d{t}`",
        "grad": f"`dE/d{t}`",
        "fixed_point": f"fixed point `{t} - dE/d{t} / {q.precision:g}`",
        "custom": ", ".join(f"`{k}`" for k in q.keys),
    }[q.kind]


def _cell(text: str) -> str:
    """Markdown for a table cell: a bar would end the cell, so math spells it in LaTeX."""
    parts = re.split(r"(\$[^$]*\$)", text)
    out = []
    for part in parts:
        if part.startswith("$") and part.endswith("$") and len(part) > 1:
            out.append(part.replace("\\|", "\\Vert ").replace("|", "\\vert "))
        else:
            out.append(part.replace("|", "\\|"))
    return "".join(out)


def model_columns(model: Callable[..., None]) -> dict[str, str]:
    """The Graph / Prior / Potentials / Value sections of a model's docstring, as Markdown.

    A section is a line ``Graph:`` (no indentation after `inspect.cleandoc`) followed by
    its indented text; a blank line or an unindented line ends it.
    """
    doc = inspect.cleandoc(model.__doc__ or "")
    cols: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        head = line.strip().rstrip(":")
        if line and not line.startswith(" ") and line.rstrip().endswith(":"):
            current = head if head in _SECTIONS else None
            if current:
                cols[current] = []
            continue
        if current and line.startswith(" "):
            cols[current].append(line.strip())
        else:
            current = None
    missing = [s for s in _SECTIONS if s not in cols]
    if missing:
        raise ValueError(f"{model.__name__}: docstring lacks the section(s) {missing}")
    return {k: " ".join(v) for k, v in cols.items()}


def model_summary(model: Callable[..., None]) -> str:
    """The first line of a model's docstring, without a leading ``Name:`` that repeats the title."""
    line = inspect.cleandoc(model.__doc__ or "").splitlines()[0].strip()
    head, sep, rest = line.partition(": ")
    if sep and "$" not in head and "`" not in head and len(head) < 60:
        line = rest[:1].upper() + rest[1:]
    return line


def model_anchor(model: Callable[..., None]) -> str:
    """The API-reference identifier of a model: its public name in `structinfer.mechanisms`,
    or its defining module's path when a submodule of the same name hides that name from
    the API renderer (``structinfer.mechanisms.hopfield`` is the module and the model)."""
    if model.__module__.rsplit(".", 1)[-1] == model.__name__:
        return f"{model.__module__}.{model.__name__}"
    return f"structinfer.mechanisms.{model.__name__}"


_MODEL_STATEMENT = re.compile(r"\b(latent_nodes|numpyro\.|edge\(|with numpyro)")


def model_excerpt(model: Callable[..., None], max_lines: int = 10) -> str:
    """Up to `max_lines` lines of the model body, from its first probabilistic statement."""
    src = inspect.getsource(model).splitlines()
    body_start = next(
        i
        for i, line in enumerate(src)
        if line.rstrip().endswith('"""') and i > 0 and src[i].strip() != 'r"""'
    )
    body = src[body_start + 1 :]
    start = next((i for i, line in enumerate(body) if _MODEL_STATEMENT.search(line)), 0)

    def indent(s: str) -> int:
        return len(s) - len(s.lstrip())

    base = min(indent(s) for s in body if s.strip())
    while start > 0 and (not body[start].strip() or indent(body[start]) > base):
        start -= 1  # begin at the enclosing statement (e.g. the loop around a site)
    lines = body[start : start + max_lines]
    indent = min(len(s) - len(s.lstrip()) for s in lines if s.strip())
    return "\n".join(s[indent:] for s in lines)


def _index(rows: Sequence[Mechanism]) -> list[str]:
    out = ["| mechanism | what it is | paper |", "| --- | --- | --- |"]
    for m in rows:
        out.append(
            f"| [{_cell(m.title)}](#{m.name}) | {_cell(model_summary(m.model))} | "
            f"{AUTHORS[m.paper]}, {_cell(m.section)} |"
        )
    return out


def _section(m: Mechanism) -> list[str]:
    c = model_columns(m.model)
    latents = (
        f" — latent sites given values: {', '.join(f'`{s}`' for s in m.latents)}"
        if m.latents
        else ""
    )
    return [
        f"### {m.title} {{#{m.name}}}",
        "",
        f"**Paper:** {AUTHORS[m.paper]}, {m.section}. "
        f"**Model:** [`{m.model.__name__}`][{model_anchor(m.model)}]{latents}.",
        "",
        *[f"**{s}.** {c[s]}\n" for s in _SECTIONS],
        "Engine quantities: " + ", ".join(describe(q) for q in m.quantities) + ".",
        "",
        f"Paper check: {m.check}.",
        "",
        "```{.python notest}",
        model_excerpt(m.model),
        "```",
        "",
    ]


def render_catalogue(rows: Sequence[Mechanism] = REGISTRY) -> str:
    """The Markdown catalogue page (`docs/catalogue.md`), generated from the registry rows."""
    for m in rows:
        citation(m)  # every paper key is known
    out = [
        "# Mechanism catalogue",
        "",
        "<!-- generated by docs/gen_catalogue.py from structinfer.testing.registry; do not edit -->",
        "",
        "Every attention and energy model of the papers, written as a NumPyro model with",
        "`structinfer.edge` sites. Each section below gives the four columns of Singh &",
        "Buckley's Table 1 (graph, prior, potentials, value), what the exact engine computes",
        "from the model, and an excerpt of it. Each row is checked by",
        "`tests/test_mechanisms.py` against an independent implementation of the paper's",
        "closed form (its reference in `structinfer.testing.registry`): jit, vmap over a",
        "batch, float32 and float64, gradients and the paper check.",
        "",
        *_index(rows),
        "",
    ]
    papers = list(dict.fromkeys(m.paper for m in rows))
    for paper in papers:
        out += [f"## {PAPERS[paper]}", ""]
        for m in rows:
            if m.paper == paper:
                out += _section(m)
    return "\n".join(out).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the page is up to date")
    args = parser.parse_args(argv)
    text = render_catalogue() + "\n"
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale; run python docs/gen_catalogue.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
