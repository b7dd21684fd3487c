"""The write and read semantics of the API server, independent of HTTP.

Handlers, the garbage collector and the kubelet-facing subresources all go through here, so
metadata rules (uid, resourceVersion, generation, finalizers, deletionTimestamp) are decided
in one place.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable
from typing import Any

from . import builtin_fields, crd_schema, crds, featuregates, kinds
from .errors import (
    ApiError,
    FieldCause,
    already_exists,
    bad_request,
    cause_forbidden,
    conflict,
    invalid,
    not_found,
)
from .meta import generated_name, new_uid, now_rfc3339
from .resources import Registry, ResourceType
from .store import Store
from .validation import check_object_size, config_data_errors, metadata_errors

CRD_KEY = "apiextensions.k8s.io/customresourcedefinitions"
NAMESPACE_KEY = "/namespaces"
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

# Built-in kinds whose strategy maintains metadata.generation (custom resources all do);
# ConfigMaps, Services, Namespaces... have none in the real server.
GENERATION_KINDS = {"Pod", "Deployment", "StatefulSet", "ReplicaSet", "Job",
                    "CustomResourceDefinition", "PodDisruptionBudget"}

# Fields outside these are "spec" for the purpose of bumping metadata.generation.
_NON_SPEC = ("metadata", "status", "apiVersion", "kind")


class Warnings(list[str]):
    """Warnings to send back as `Warning: 299 - "..."` headers."""


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in _NON_SPEC}


def _strip_rv(obj: dict[str, Any]) -> dict[str, Any]:
    out = dict(obj)
    out["metadata"] = {k: v for k, v in obj.get("metadata", {}).items()
                       if k != "resourceVersion"}
    return out


# A validating admission plugin: (type, new object, old object or None, subresource); raises.
AdmissionHook = Callable[[ResourceType, dict[str, Any], "dict[str, Any] | None", "str | None"],
                         None]


class Core:
    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        self.admission: list[AdmissionHook] = []
        self.feature_gates = featuregates.FeatureGates()

    # ---- bootstrap ---------------------------------------------------------------------
    def bootstrap(self) -> None:
        ns_type = self.registry.get("", "v1", "namespaces")
        assert ns_type is not None
        for name in SYSTEM_NAMESPACES:
            if self.store.peek(NAMESPACE_KEY, "", name) is None:
                self.create(ns_type, None, {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": name}})

    def register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        self.registry.remove_group_plural(spec["group"], spec["names"]["plural"])
        for rt in crds.resource_types(crd):
            self.registry.add(rt)

    def unregister_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        self.registry.remove_group_plural(spec["group"], spec["names"]["plural"])
        self.store.drop_type(f"{spec['group']}/{spec['names']['plural']}")

    # ---- helpers -------------------------------------------------------------------------
    def _require(self, rt: ResourceType, ns: str, name: str) -> dict[str, Any]:
        obj = self.store.get(rt.key, ns, name)
        if obj is None:
            raise not_found(rt.plural, rt.group, name)
        return obj

    def _check_namespace(self, rt: ResourceType, ns: str | None) -> None:
        if not rt.namespaced:
            return
        namespace = self.store.peek(NAMESPACE_KEY, "", ns or "")
        if namespace is None:
            raise not_found("namespaces", "", ns or "")
        if namespace["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden",
                           f'{rt.plural}{"." + rt.group if rt.group else ""} '
                           f'"{{name}}" is forbidden: unable to create new content in namespace '
                           f"{ns} because it is being terminated",
                           {"name": "", "group": rt.group, "kind": rt.plural,
                            "causes": [{"reason": "NamespaceTerminating",
                                        "message": f"namespace {ns} is being terminated",
                                        "field": "metadata.namespace"}]})

    def _check_identity(self, rt: ResourceType, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request was not a {rt.kind} object")
        api_version = body.get("apiVersion")
        if api_version and api_version != rt.api_version:
            if rt.builtin and api_version.rpartition("/")[0] == rt.group:
                pass  # another version of the same group: served here as this version
            else:
                raise bad_request(f"the API version in the data ({api_version}) does not match "
                                  f"the expected API version ({rt.api_version})")
        kind = body.get("kind")
        if kind and kind != rt.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected kind "
                              f"({rt.kind})")
        if not kind and not rt.builtin:
            raise bad_request(f"Object 'Kind' is missing in '{body}'")
        body["apiVersion"] = rt.api_version
        body["kind"] = rt.kind
        meta = body.get("metadata")
        if meta is None:
            body["metadata"] = meta = {}
        if not isinstance(meta, dict):
            raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a '
                              f"{rt.kind}: json: cannot unmarshal "
                              f"{builtin_fields.json_kind(meta)} into Go struct field "
                              f"{rt.kind}.metadata of type v1.ObjectMeta")
        problem = builtin_fields.metadata_type_error(meta)
        if problem:
            raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a '
                              f"{rt.kind}: {problem}")
        return meta

    def _prepare_builtin(self, rt: ResourceType, obj: dict[str, Any], field_validation: str,
                         warnings: Warnings) -> None:
        """Drop fields the kind does not have (reject or warn under Strict/Warn)."""
        problem = builtin_fields.type_error(rt.group, rt.kind, obj)
        if problem:
            raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a '
                              f"{rt.kind}: {problem}")
        unknown = builtin_fields.prune_unknown(rt.group, rt.kind, obj)
        self._report_unknown(rt, unknown, field_validation, warnings)

    @staticmethod
    def _report_unknown(rt: ResourceType, unknown: list[str], field_validation: str,
                        warnings: Warnings) -> None:
        if unknown and field_validation == "Strict":
            listed = ", ".join(f'unknown field "{p}"' for p in unknown)
            raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a '
                              f"{rt.kind}: strict decoding error: {listed}")
        if unknown and field_validation == "Warn":
            warnings.extend(f'unknown field "{p}"' for p in unknown)

    def _prepare_custom(self, rt: ResourceType, obj: dict[str, Any], field_validation: str,
                        warnings: Warnings) -> dict[str, Any]:
        """Prune unknown fields (reject or warn under Strict/Warn) and apply defaults."""
        assert rt.crd is not None
        unknown = crd_schema.unknown_fields(rt.crd, obj)
        self._report_unknown(rt, unknown, field_validation, warnings)
        return crd_schema.default_and_prune(rt.crd, obj)

    def _validate(self, rt: ResourceType, obj: dict[str, Any],
                  old: dict[str, Any] | None) -> None:
        meta = obj["metadata"]
        errors: list[FieldCause] = []
        if old is None:
            errors += metadata_errors(rt.kind, meta, rt.namespaced)
        errors += config_data_errors(rt.kind, obj)
        if rt.builtin:
            errors += kinds.validate(rt.kind, obj, old)
            if rt.kind == "Pod":
                errors += featuregates.restart_rule_errors(
                    obj.get("spec"), (old or {}).get("spec"), self.feature_gates)
            if rt.kind == "CustomResourceDefinition":
                errors += crds.crd_errors(obj)
        else:
            assert rt.crd is not None
            errors += crd_schema.validate_prepared(rt.crd, obj, old)
        if old is not None:
            errors += self._finalizer_errors(obj, old)
        if errors:
            raise invalid(rt.kind, rt.group, meta.get("name", ""), errors)
        check_object_size(obj)

    @staticmethod
    def _finalizer_errors(obj: dict[str, Any], old: dict[str, Any]) -> list[FieldCause]:
        if not old["metadata"].get("deletionTimestamp"):
            return []
        added = [f for f in obj["metadata"].get("finalizers") or []
                 if f not in (old["metadata"].get("finalizers") or [])]
        if added:
            shown = ", ".join(f'"{f}"' for f in added)
            return [cause_forbidden("metadata.finalizers",
                                    f"no new finalizers can be added if the object is being "
                                    f"deleted, found new finalizers []string{{{shown}}}")]
        return []

    # ---- create ----------------------------------------------------------------------------
    def create(self, rt: ResourceType, ns: str | None, body: Any, *, dry_run: bool = False,
               field_validation: str = "Ignore",
               warnings: Warnings | None = None) -> dict[str, Any]:
        warnings = warnings if warnings is not None else Warnings()
        meta = self._check_identity(rt, body)
        obj = body
        if rt.namespaced:
            body_ns = meta.get("namespace")
            if body_ns and ns and body_ns != ns:
                raise bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
            meta["namespace"] = ns or body_ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = generated_name(meta["generateName"])
        if not rt.builtin:
            obj = self._prepare_custom(rt, obj, field_validation, warnings)
            meta = obj["metadata"]
        else:
            self._prepare_builtin(rt, obj, field_validation, warnings)
        if rt.status_subresource and kinds.strip_status_on_create(rt.kind):
            obj.pop("status", None)
        used_ips = ({(o.get("spec") or {}).get("clusterIP", "") for o in self.store.iter(rt.key)}
                    if rt.kind == "Service" else set())
        if rt.kind == "Pod":
            featuregates.drop_disabled_pod_fields(obj.get("spec"), None, self.feature_gates)
        kinds.default_on_create(rt.kind, obj, used_ips)
        if rt.kind == "CustomResourceDefinition":
            crds.default_crd(obj)
        self._validate(rt, obj, None)
        self._check_namespace(rt, meta.get("namespace"))
        for hook in self.admission:
            hook(rt, obj, None, None)
        name = meta["name"]
        if self.store.peek(rt.key, meta.get("namespace", ""), name) is not None:
            raise already_exists(rt.plural, rt.group, name)
        for server_field in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields",
                             "selfLink"):
            meta.pop(server_field, None)
        meta["uid"] = new_uid()
        meta["creationTimestamp"] = now_rfc3339()
        if not rt.builtin or rt.kind in GENERATION_KINDS:
            meta["generation"] = 1
        else:
            meta.pop("generation", None)
        if rt.kind == "CustomResourceDefinition":
            crds.set_status(obj)
            # Deleting a CRD first deletes its custom resources (see gc.py).
            finalizers = meta.setdefault("finalizers", [])
            if crds.CLEANUP_FINALIZER not in finalizers:
                finalizers.append(crds.CLEANUP_FINALIZER)
        elif not rt.builtin:
            self._check_crd_not_terminating(rt)
        if dry_run:
            meta["resourceVersion"] = ""
            return obj
        stored = self.store.put(rt.key, obj, "ADDED")
        if rt.kind == "CustomResourceDefinition":
            self.register_crd(copy.deepcopy(stored))
        if rt.kind == "Namespace":
            self._default_service_account(name)
        return stored

    def _default_service_account(self, namespace: str) -> None:
        """What the serviceaccount controller does for every new namespace."""
        sa_type = self.registry.get("", "v1", "serviceaccounts")
        if sa_type is not None and self.store.peek(sa_type.key, namespace, "default") is None:
            self.create(sa_type, namespace, {"apiVersion": "v1", "kind": "ServiceAccount",
                                             "metadata": {"name": "default"}})

    def _check_crd_not_terminating(self, rt: ResourceType) -> None:
        crd = self.store.peek(CRD_KEY, "", f"{rt.plural}.{rt.group}")
        if crd is not None and crd["metadata"].get("deletionTimestamp"):
            raise ApiError(405, "MethodNotAllowed", "create not allowed while custom resource "
                           "definition is terminating", {})

    # ---- update ----------------------------------------------------------------------------
    def update(self, rt: ResourceType, ns: str, name: str, body: Any, *,
               subresource: str | None = None, dry_run: bool = False,
               field_validation: str = "Ignore", warnings: Warnings | None = None,
               current: dict[str, Any] | None = None) -> dict[str, Any]:
        warnings = warnings if warnings is not None else Warnings()
        meta = self._check_identity(rt, body)
        if meta.get("name") and meta["name"] != name:
            raise bad_request(f"the name of the object ({meta['name']}) does not match the name "
                              f"on the URL ({name})")
        old = current if current is not None else self._require(rt, ns, name)
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt.plural, rt.group, name)
        if rt.namespaced:
            body_ns = meta.get("namespace")
            if body_ns and body_ns != ns:
                raise bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
        obj = self._compose_update(rt, old, body, subresource)
        if not rt.builtin:
            obj = self._prepare_custom(rt, obj, field_validation, warnings)
        else:
            self._prepare_builtin(rt, obj, field_validation, warnings)
        if rt.kind == "Pod":
            featuregates.drop_disabled_pod_fields(obj.get("spec"), old.get("spec"),
                                                  self.feature_gates)
        kinds.default_on_update(rt.kind, obj, old)
        if rt.kind == "CustomResourceDefinition":
            crds.default_crd(obj)
            crds.set_status(obj)
            if (old.get("status") or {}).get("acceptedNames") == obj["status"]["acceptedNames"]:
                obj["status"]["conditions"] = old["status"]["conditions"]  # keep their times
        if "generation" in old["metadata"] and _spec_part(obj) != _spec_part(old):
            obj["metadata"]["generation"] = old["metadata"]["generation"] + 1
        self._validate(rt, obj, old)
        for hook in self.admission:
            hook(rt, obj, old, subresource)
        if _strip_rv(obj) == _strip_rv(old):
            return old  # a no-op write keeps the resourceVersion, like the real server
        if dry_run:
            return obj
        written = self._write(rt, obj)
        if rt.kind == "CustomResourceDefinition" and self.store.peek(
                CRD_KEY, "", written["metadata"]["name"]) is not None:
            self.register_crd(copy.deepcopy(written))  # new schema, columns, versions
        return written

    def _compose_update(self, rt: ResourceType, old: dict[str, Any], body: dict[str, Any],
                        subresource: str | None) -> dict[str, Any]:
        if subresource == "status":
            obj = copy.deepcopy(old)
            if "status" in body:
                obj["status"] = body["status"]
            else:
                obj.pop("status", None)
            return obj
        obj = body  # callers hand over a fresh object (parsed or patched)
        if rt.status_subresource:
            if "status" in old:
                obj["status"] = copy.deepcopy(old["status"])
            else:
                obj.pop("status", None)
        meta = obj["metadata"]
        old_meta = old["metadata"]
        for keep in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                     "deletionGracePeriodSeconds", "generation", "resourceVersion"):
            if keep in old_meta:
                meta[keep] = old_meta[keep]
            else:
                meta.pop(keep, None)
        meta.pop("managedFields", None)
        if rt.kind == "Namespace":
            obj["spec"] = copy.deepcopy(old.get("spec", {}))
        return obj

    def _write(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an update; an object being deleted whose last finalizer went is removed."""
        meta = obj["metadata"]
        # The generic registry's rule: no finalizers left and no grace period pending.
        if (meta.get("deletionTimestamp") and not meta.get("finalizers")
                and meta.get("deletionGracePeriodSeconds") == 0 and rt.kind != "Namespace"):
            gone = self.store.remove(rt.key, meta.get("namespace", ""), meta["name"])
            if rt.kind == "CustomResourceDefinition" and gone is not None:
                self.unregister_crd(gone)
            return gone or obj
        return self.store.put(rt.key, obj, "MODIFIED")

    # ---- delete ------------------------------------------------------------------------------
    def delete(self, rt: ResourceType, ns: str, name: str, options: dict[str, Any] | None = None,
               *, dry_run: bool = False, propagation: str | None = None,
               grace_period: int | None = None) -> dict[str, Any]:
        options = options or {}
        obj = self._require(rt, ns, name)
        meta = obj["metadata"]
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(rt.plural, rt.group, name,
                           f"Precondition failed: UID in precondition: {pre['uid']}, UID in "
                           f"object meta: {meta['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise conflict(rt.plural, rt.group, name,
                           f"Precondition failed: ResourceVersion in precondition: "
                           f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                           f"{meta['resourceVersion']}")
        policy = propagation or options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is True:
            policy = "Orphan"
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise invalid("DeleteOptions", "", "", [FieldCause(
                "propagationPolicy", "FieldValueNotSupported",
                f'Unsupported value: "{policy}": supported values: "Foreground", '
                '"Background", "Orphan", "nil"')])
        if grace_period is None:
            grace_period = options.get("gracePeriodSeconds")
        if dry_run:
            return obj
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if policy == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        if rt.kind == "Namespace":
            return self._start_namespace_deletion(rt, obj)
        graceful = rt.kind == "Pod" and self._pod_needs_grace(obj, grace_period)
        if finalizers or graceful:
            if meta.get("deletionTimestamp") and not graceful and (
                    finalizers == (meta.get("finalizers") or [])
                    and meta.get("deletionGracePeriodSeconds") == 0):
                return obj  # already being deleted: nothing changes
            meta["finalizers"] = finalizers
            if not finalizers:
                meta.pop("finalizers")
            if graceful:
                grace = int(grace_period if grace_period is not None
                            else obj["spec"].get("terminationGracePeriodSeconds", 30))
                when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=grace)
                deadline = when.strftime("%Y-%m-%dT%H:%M:%SZ")
                # A second delete may shorten the grace period, never extend it.
                if not meta.get("deletionTimestamp") or deadline < meta["deletionTimestamp"]:
                    meta["deletionTimestamp"] = deadline
                    meta["deletionGracePeriodSeconds"] = grace
            else:
                meta.setdefault("deletionTimestamp", now_rfc3339())
                meta["deletionGracePeriodSeconds"] = 0
            return self.store.put(rt.key, obj, "MODIFIED")
        gone = self.store.remove(rt.key, ns, name)
        assert gone is not None
        if rt.kind == "CustomResourceDefinition":
            self.unregister_crd(gone)
        return gone

    @staticmethod
    def _pod_running(pod: dict[str, Any]) -> bool:
        return bool(pod.get("spec", {}).get("nodeName")) and (
            pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"))

    def _pod_needs_grace(self, pod: dict[str, Any], grace_period: int | None) -> bool:
        """Bound, unfinished pods wait for their kubelet; the rest go at once (as upstream)."""
        if grace_period == 0:
            return False
        return self._pod_running(pod)

    def _start_namespace_deletion(self, rt: ResourceType, ns_obj: dict[str, Any]) -> dict[str, Any]:
        meta = ns_obj["metadata"]
        if meta.get("deletionTimestamp"):
            return ns_obj
        meta["deletionTimestamp"] = now_rfc3339()
        meta["deletionGracePeriodSeconds"] = 0
        ns_obj.setdefault("status", {})["phase"] = "Terminating"
        return self.store.put(rt.key, ns_obj, "MODIFIED")

    def finish_namespace(self, name: str) -> None:
        self.store.remove(NAMESPACE_KEY, "", name)

    # ---- reads -------------------------------------------------------------------------------
    def get(self, rt: ResourceType, ns: str, name: str) -> dict[str, Any]:
        obj = self._require(rt, ns, name)
        return self._present(rt, obj)

    def _present(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """Objects are stored once per group/plural; serve them in the requested version."""
        if obj.get("apiVersion") != rt.api_version:
            obj["apiVersion"] = rt.api_version
        return obj
