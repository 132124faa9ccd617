"""MkDocs hook: writes the reference pages from the code at build time, so they cannot drift.

- ``reference/configuration.md``: every field of ``atomd.spec.JobSpec``, ``atomd.spec.SyncSpec``
  and ``atomd.config.Settings`` (name, type, default, description; the environment variable
  for each setting of the daemon).
- ``reference/rest-api.md``: every path and method of the daemon's control API, read from the
  FastAPI app's OpenAPI schema (summary, parameters, request body, responses).

It also publishes the measurements' result files (``research/results/*.json``, outside the
docs folder) under ``research/results/`` in the site, and points the pages' links to them
(written relative to the page's file in the repository) at those copies.

mkdocs.yml names this file under ``hooks:``; the pages exist only in the built site.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import posixpath
import re
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

CONFIGURATION = "reference/configuration.md"
REST_API = "reference/rest-api.md"
REPO = Path(__file__).resolve().parents[2]
PUBLISHED = "research/results"  # a folder of the repository, published at the same path
_LINK = re.compile(r"(\]\()([^)\s]+)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path, text in ((CONFIGURATION, configuration_page()), (REST_API, rest_api_page())):
        files.append(File.generated(config, path, content=text))
    for result in sorted((REPO / PUBLISHED).glob("*.json")):
        uri = result.relative_to(REPO).as_posix()
        files.append(File(uri, str(REPO), config.site_dir, config.use_directory_urls))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """A link from a page to a published file of the repository (``../research/results/x.json``
    from docs/) points at its copy in the site instead."""
    page_dir = (Path(config.docs_dir) / page.file.src_uri).parent

    def published(match: re.Match[str]) -> str:
        target = match[2]
        if "://" in target or target.startswith(("#", "mailto:")):
            return match[0]
        path = (page_dir / target).resolve()
        if not path.is_relative_to(REPO / PUBLISHED):
            return match[0]
        site_path = path.relative_to(REPO).as_posix()
        here = posixpath.dirname(page.file.src_uri) or "."
        return f"{match[1]}{posixpath.relpath(site_path, here)})"

    return _LINK.sub(published, markdown)


# --- configuration --------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(see below)"
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        shown = json.dumps(value)
    except TypeError:
        shown = str(value)
    return f"`{shown}`"


def _table(
    model: type[BaseModel], env_prefix: str | None = None, fields: tuple[str, ...] | None = None
) -> str:
    """A table of ``model``'s fields (``fields``: only those, in that order)."""
    head = ["field", "type", "default", "description"]
    if env_prefix is not None:
        head.insert(1, "environment variable")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in fields or tuple(model.model_fields):
        info = model.model_fields[name]
        row = [
            f"`{name}`",
            _cell(_type_name(info.annotation)),
            _cell(_default(info)),
            _cell(info.description or ""),
        ]
        if env_prefix is not None:
            row.insert(1, f"`{env_prefix}{name.upper()}`")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def configuration_page() -> str:
    from atomd.config import ENV_PREFIX, Settings
    from atomd.spec import JOB_SPEC_GROUPS, JobSpec, SyncSpec

    groups = [
        f"### {group}\n\n{_table(JobSpec, fields=fields)}"
        for group, fields in JOB_SPEC_GROUPS.items()
    ]

    return "\n\n".join(
        [
            "# Configuration",
            "This page is generated from the code when the site is built: each table lists "
            "every field of one model, with its type, default and description.",
            "## Job spec (`JobSpec`)",
            "A training job: the body of `POST /v1/jobs`, the file `atomd train --spec` "
            "reads, and the spec a swarm's peers agree on. Every field has a default: "
            '`{"preset": "tiny"}` is a valid job. Its fields, by concern:',
            *groups,
            "## Synchronisation (`SyncSpec`, the job spec's `sync`)",
            "How peers exchange weight deltas: what the job spec's `sync` object holds.",
            _table(SyncSpec),
            "## Daemon settings (`Settings`)",
            f"The daemon's own settings: read from the environment (the prefix `{ENV_PREFIX}`) "
            "and from `atomd run`'s flags.",
            _table(Settings, env_prefix=ENV_PREFIX),
            "",
        ]
    )


# --- REST API ---------------------------------------------------------------------------------


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list of {_schema_name(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    return f"`{schema.get('type', 'any')}`"


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        out += [op["summary"], ""]
    if op.get("description"):
        out += [op["description"], ""]
    params = [p for p in op.get("parameters", []) if p["name"].lower() != "authorization"]
    if params:
        out += [
            "| parameter | in | type | required | description |",
            "| --- | --- | --- | --- | --- |",
        ]
        for p in params:
            schema = p.get("schema", {})
            out.append(
                f"| `{p['name']}` | {p['in']} | {_schema_name(schema)} | "
                f"{'yes' if p.get('required') else 'no'} | "
                f"{_cell(p.get('description') or schema.get('description', ''))} |"
            )
        out.append("")
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    if body:
        out += [f"Request body: {_schema_name(body.get('schema', {}))}", ""]
    out += ["| status | response |", "| --- | --- |"]
    for status, response in op.get("responses", {}).items():
        content = response.get("content", {})
        if "application/json" in content:
            shown = _schema_name(content["application/json"].get("schema", {}))
        else:
            shown = ", ".join(f"`{c}`" for c in content) or "no body"
        out.append(f"| {status} | {shown}: {_cell(response.get('description', ''))} |")
    return [*out, ""]


def _component(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [_cell(schema["description"]), ""]
    props = schema.get("properties", {})
    if not props:
        return out
    required = set(schema.get("required", []))
    out += ["| field | type | required | description |", "| --- | --- | --- | --- |"]
    for field, prop in props.items():
        out.append(
            f"| `{field}` | {_schema_name(prop)} | {'yes' if field in required else 'no'} | "
            f"{_cell(prop.get('description', ''))} |"
        )
    return [*out, ""]


def openapi_schema() -> dict[str, Any]:
    """The control API's schema, from the app the daemon serves (no daemon started: the
    schema needs only the routes, so the daemon's parts are left out)."""
    from atomd.config import Settings
    from atomd_api.control import ControlContext, create_control_app

    given: dict[str, Any] = {"settings": Settings(), "readiness": dict, "started_at": 0.0}
    required = [
        f.name
        for f in dataclasses.fields(ControlContext)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    args: dict[str, Any] = {name: given.get(name) for name in required}
    ctx = ControlContext(**args)
    return create_control_app(ctx).openapi()


def rest_api_page() -> str:
    schema = openapi_schema()
    out = [
        "# REST API",
        "",
        "This page is generated from the control API's OpenAPI schema when the site is built. "
        "A running daemon serves the same schema at `/openapi.json`, with Swagger UI at "
        "`/docs` and ReDoc at `/redoc`. Every route except `/healthz` needs the header "
        "`Authorization: Bearer <token>` (see the [daemon's guide](../guide/daemon.md)).",
        "",
        f"{schema['info']['title']}, version {schema['info']['version']}.",
        "",
        "## Routes",
        "",
    ]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            out += _operation(path, method, op)
    out += ["## Schemas", ""]
    for name, component in sorted(schema.get("components", {}).get("schemas", {}).items()):
        out += _component(name, component)
    return "\n".join(out)
