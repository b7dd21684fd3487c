"""core/v1 Volume and VolumeMount as typed models, built from the kubernetes client's.

`podTemplate.volumes` used to be free-form (`x-kubernetes-preserve-unknown-fields`), so the
API server stored any JSON there, nested as deep as its decoder allows. Typed, the CRD schema
prunes or refuses what core/v1 does not define, and nothing deeper than core/v1 is stored.
The kubernetes client's models carry the core/v1 field names and types (`openapi_types`,
`attribute_map`), so the shapes come from there rather than from a copy kept here.
"""

from __future__ import annotations

import re
from typing import Any

from kubernetes.client import models as k8s
from pydantic import BaseModel, Field, create_model

# The client types resource.Quantity fields as plain strings; the API takes numbers too.
_QUANTITIES = {("V1EmptyDirVolumeSource", "size_limit"), ("V1ResourceFieldSelector", "divisor"),
               ("V1VolumeResourceRequirements", "limits"),
               ("V1VolumeResourceRequirements", "requests")}
_REQUIRED = {("V1Volume", "name"), ("V1VolumeMount", "name"), ("V1VolumeMount", "mount_path")}
# A PersistentVolumeClaim template's metadata: what a template may set. The rest of ObjectMeta
# (managedFields holds free-form JSON) is the API server's to fill in.
_TEMPLATE_METADATA = ("labels", "annotations")


def typed_model(name: str, base: type[BaseModel], quantity: Any,
                _built: dict[str, type[BaseModel]] | None = None) -> type[BaseModel]:
    """The pydantic model of core/v1 type `name` (e.g. "V1Volume") on `base`, every field
    optional unless core/v1 requires it, camelCase as on the wire."""
    built = {} if _built is None else _built
    if name in built:
        return built[name]
    source = getattr(k8s, name)
    fields: dict[str, Any] = {}
    for attr, type_text in source.openapi_types.items():
        if name == "V1ObjectMeta" and attr not in _TEMPLATE_METADATA:
            continue
        annotation = _annotation(name, attr, type_text, base, quantity, built)
        alias = source.attribute_map[attr]
        if (name, attr) in _REQUIRED:
            fields[attr] = (annotation, Field(alias=alias, min_length=1))
        else:
            fields[attr] = (annotation | None, Field(None, alias=alias))
    model = create_model(name.removeprefix("V1"), __base__=base,
                         __doc__=f"core/v1 {name.removeprefix('V1')}.", **fields)
    built[name] = model
    return model


def _annotation(owner: str, attr: str, text: str, base: type[BaseModel], quantity: Any,
                built: dict[str, type[BaseModel]]) -> Any:
    listed = re.fullmatch(r"list\[(.+)\]", text, re.IGNORECASE)
    if listed:
        return list[_annotation(owner, attr, listed.group(1), base, quantity, built)]  # type: ignore[misc]
    mapped = re.fullmatch(r"dict[\[(]str, (.+)[\])]", text, re.IGNORECASE)
    if mapped:
        return dict[str, _annotation(owner, attr, mapped.group(1), base, quantity,  # type: ignore[misc]
                                     built)]
    if (owner, attr) in _QUANTITIES:
        return quantity
    scalars = {"str": str, "int": int, "bool": bool, "float": float}
    if text in scalars:
        return scalars[text]
    if hasattr(k8s, text):
        return typed_model(text, base, quantity, built)
    raise TypeError(f"{owner}.{attr}: no typed schema for {text!r}")
