"""Thin kopf handlers: parse → build → adopt → create-or-patch → status.

Everything with a decision in it lives in a pure module (`crd`, `resources`, `status`, `autoscale`);
this file only moves data between kopf, the API server and those functions.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import kopf

from kvmesh.index.layout import KeySpace

from . import API_VERSION, GROUP, KIND, PLURAL, VERSION, autoscale, crd, lora_sync, redis_auth, redis_cleanup
from . import resources as R
from . import status as S
from .apply import NotOwned, apply, controlled_by, fingerprint_key, fingerprints_update
from .kube import KubeClient, KubeError

FINALIZER = "kvmesh.io/finalizer"
# NOTE: not kopf's per-handler logger: that one posts warnings as Events on the resource.
log = logging.getLogger("kvmesh.operator")


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    resync_seconds: float = 15.0  # timer: repair drift, refresh status, autoscale
    cleanup_retries: int = 3  # Redis cleanup attempts at deletion before giving up
    cleanup_delay_seconds: float = 10.0  # between those attempts
    metrics_port: int = R.ENGINE_PORT  # engine pods' HTTP port: autoscaler scrapes, LoRA adapter loads
    router_metrics_port: int = R.ROUTER_PORT  # where it scrapes router pods (minReplicas 0: held requests)
    lora_retry_seconds: float = 60.0  # before asking a pod again to load an adapter it refused
    operator_namespace: str | None = None  # the managed Redis' NetworkPolicy admits the operator from here
    watch_secrets: bool = False  # watch the Secrets the operator owns (needs list/watch on Secrets)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds_since(stamp: str | None) -> float | None:
    if not stamp:
        return None
    then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    return (datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()


def _finalized(memo: Any) -> "collections.OrderedDict[str, str]":
    """uid -> outcome of the deletions whose cleanup ended (cleaned or given up), newest last.

    kopf can run a deletion handler again for a resource still holding the finalizer (a watch
    event that arrives before the finalizer's removal lands, progress lost with a conflicting
    patch): the cleanup's outcome is final for a deletion, so the rerun only releases.
    """
    if getattr(memo, "finalized", None) is None:
        memo.finalized = collections.OrderedDict()
    return memo.finalized


def _remember_finalized(memo: Any, uid: str, outcome: str) -> None:
    done = _finalized(memo)
    done[uid] = outcome
    while len(done) > 4096:
        done.popitem(last=False)


def _warned(memo: Any) -> set[str]:
    if getattr(memo, "forbidden_warned", None) is None:
        memo.forbidden_warned = set()
    return memo.forbidden_warned


def _lora_state(memo: Any, uid: str) -> lora_sync.SyncState:
    """One service's adapter syncs: the adapters its pods refused (retried after
    OperatorConfig.lora_retry_seconds) and the lock that keeps two syncs apart."""
    if getattr(memo, "lora_states", None) is None:
        memo.lora_states = {}
    return memo.lora_states.setdefault(uid, lora_sync.SyncState())


def _kube(memo: Any) -> KubeClient:
    kube = getattr(memo, "kube", None)
    if kube is None:
        raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
    return kube


class ChildConflict(Exception):
    """Some children's names are taken by objects the operator does not own (status says which)."""


def _parse(name: str, namespace: str, spec: Any, body: Any, patch: Any, status: Any, meta: Any
           ) -> crd.InferenceService:
    """Parse the spec; an invalid one is written to status and becomes a PermanentError."""
    try:
        return crd.parse(name, namespace, dict(spec or {}))
    except crd.SpecError as err:
        patch.status.update(S.invalid_status(err.problems, meta.get("generation"),
                                             list(status.get("conditions") or []), _now()))
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(err))
        raise kopf.PermanentError(f"invalid spec: {err}") from err


def is_forbidden_optional(err: KubeError, kind: str) -> bool:
    """A 403 on a kind whose RBAC the chart makes optional: that kind is not managed here."""
    return err.status == 403 and kind in R.OPTIONAL_KINDS


def _tolerate_forbidden(err: KubeError, kind: str, warned: set[str]) -> None:
    """Re-raise `err` unless it is a 403 on an optional kind; that one is logged once."""
    if not is_forbidden_optional(err, kind):
        raise err
    if kind not in warned:  # once per operator process, not once per resync
        warned.add(kind)
        log.warning("no RBAC for %s (chart value %s=false): not managing them", kind, R.OPTIONAL_KINDS[kind])


def _note_action(body: Any, child: dict[str, Any], action: str) -> None:
    what = f"{child['kind']} {child['metadata']['name']}"
    if action == "reverted":
        kopf.event(body, type="Warning", reason="Reverted", message=f"reverted {what}: changed outside the operator")
    elif action != "unchanged":
        kopf.event(body, type="Normal", reason=action.capitalize(), message=f"{action} {what}")


async def _read_secret(kube: KubeClient, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
    """(readable, the Secret or None when absent); not readable: a 403 (rbac.readSecrets=false)."""
    try:
        return True, await kube.get("v1", "Secret", namespace, name)
    except KubeError as err:
        if err.status != 403:
            raise
        return False, None


async def ensure_redis_secret(kube: KubeClient, svc: crd.InferenceService, owner: R.Owner, body: Any,
                              recorded: str | None = None) -> tuple[NotOwned | None, str | None]:
    """Create the managed Redis' password Secret when absent; never patch or rotate it.

    Returns (a conflict if a same-named Secret is not ours, the password's checksum: from the live
    Secret, from the one just created, else `recorded`, the last one known).
    """
    name = R.redis_secret_name(svc)
    readable, live = await _read_secret(kube, svc.namespace, name)
    if live is not None:
        if not controlled_by(live, owner.uid):
            return NotOwned("Secret", name, owner.uid), None
        return None, redis_auth.secret_checksum(live, R.REDIS_PASSWORD_KEY) or recorded
    # NOTE: 32 random bytes from `secrets`; the only copy is the Secret (never logged or in status).
    password = secrets.token_urlsafe(32)
    try:
        await kube.create(R.build_redis_secret(svc, owner, password))
    except KubeError as err:
        if err.status != 409:
            raise
        return None, recorded  # NOTE: unreadable but there (rbac.readSecrets=false): a 409 means it exists
    kopf.event(body, type="Normal", reason="Created", message=f"created Secret {name}"
               + ("" if readable or recorded is None else " (it was gone: the pods roll to the new password)"))
    return None, redis_auth.checksum(password)


async def external_redis_checksum(kube: KubeClient, svc: crd.InferenceService, recorded: str | None) -> str | None:
    """The external Redis password's checksum when the operator may read its Secret, else `recorded`.

    NOTE: a missing Secret keeps the last checksum: rolling pods onto a Secret that is not there would
    only trade running pods for ones that cannot start.
    """
    ref = svc.redis.password_secret
    if ref is None:
        return None
    _, live = await _read_secret(kube, svc.namespace, ref.name)
    return redis_auth.secret_checksum(live, ref.key) or recorded


async def sync(kube: KubeClient, svc: crd.InferenceService, uid: str, body: Any, meta: Any, status: Any,
               patch: Any, autoscaled: int | None, warned: set[str] | None = None,
               operator_namespace: str | None = None, full_sweep: bool = True,
               config: OperatorConfig | None = None, lora_state: lora_sync.SyncState | None = None) -> None:
    """Make every child match the spec, delete the ones no longer wanted, then write status.

    `warned`: optional kinds already logged as forbidden (shared across syncs to log each once).
    `full_sweep`: look for every child any spec could have (after a spec change); else only for
    those recorded in status.childFingerprints (the resync: fewer reads on every tick).
    """
    warned = set() if warned is None else warned
    owner = R.Owner(name=svc.name, uid=uid)
    live = await _live(kube, svc, uid)
    if live is not None and (live.get("metadata") or {}).get("deletionTimestamp"):
        return  # NOTE: being deleted (the handler's body may predate it): the finalizer's turn, not ours
    status = (live.get("status") or {}) if live is not None else status
    replicas = R.engine_replicas(svc, autoscaled)
    observed: S.Observed = {}
    forbidden: set[str] = set()
    recorded = dict(status.get("childFingerprints") or {})
    fingerprints: dict[str, str] = {}
    conflicts: list[NotOwned] = []
    auth: str | None = None
    try:
        known = await _running_checksum(kube, svc, status) if R.needs_redis(svc) else None
        if svc.redis.managed and R.needs_redis(svc):
            conflict, auth = await ensure_redis_secret(kube, svc, owner, body, known)
            if conflict is not None:
                conflicts.append(conflict)
        elif R.needs_redis(svc):
            auth = await external_redis_checksum(kube, svc, known)
        desired = R.build_children(svc, owner, replicas, operator_namespace, auth)
        for child in desired:
            key = fingerprint_key(child)
            try:
                if conflicts:  # NOTE: later children depend on earlier ones: only look, write nothing
                    live = await kube.get(child["apiVersion"], child["kind"], svc.namespace, child["metadata"]["name"])
                    if live is not None and not controlled_by(live, uid):
                        conflicts.append(NotOwned(child["kind"], child["metadata"]["name"], uid))
                    elif live is not None:
                        observed[R.child_key(child)] = live
                    continue
                result = await apply(kube, child, recorded.get(key))
            except NotOwned as err:
                conflicts.append(err)
                continue
            except KubeError as err:
                _tolerate_forbidden(err, child["kind"], warned)
                forbidden.add(child["kind"])
                continue
            observed[R.child_key(child)] = result.obj
            fingerprints[key] = result.fingerprint
            _note_action(body, child, result.action)
        wanted = {R.child_key(c) for c in desired}
        for api_version, kind, name in R.possible_children(svc):
            if (api_version, kind, name) in wanted or kind in forbidden:
                continue
            if not full_sweep and f"{kind}/{name}" not in recorded:
                continue  # NOTE: never written (or its deletion already recorded): nothing to delete
            try:
                live = await kube.get(api_version, kind, svc.namespace, name)
                if live is not None and controlled_by(live, uid):  # only ever delete what we own
                    await kube.delete(api_version, kind, svc.namespace, name)
                    kopf.event(body, type="Normal", reason="Deleted",
                               message=f"deleted {kind} {name} (no longer in the spec)")
            except KubeError as err:
                _tolerate_forbidden(err, kind, warned)
    except KubeError as err:
        # NOTE: a merge patch: children not reached this time keep their recorded fingerprints.
        patch.status["childFingerprints"] = fingerprints
        kopf.event(body, type="Warning", reason="ApplyFailed", message=str(err))
        raise kopf.TemporaryError(str(err), delay=10) from err
    previous = list(status.get("conditions") or [])
    if conflicts:
        patch.status["childFingerprints"] = fingerprints
    else:
        patch.status["childFingerprints"] = fingerprints_update(recorded, fingerprints)
    engine = observed.get(("apps/v1", "Deployment", R.engine_name(svc))) or {}
    want = replicas if replicas is not None else int((engine.get("spec") or {}).get("replicas") or 0)
    pods = await _engine_pods(kube, svc) if svc.model.remote or svc.lora_enabled else []
    adapters = await _sync_adapters(kube, svc, pods, body, config or OperatorConfig(),
                                    lora_state or lora_sync.SyncState()) if svc.lora_enabled else None
    if adapters is None and status.get("loraAdapters") is not None:
        patch.status["loraAdapters"] = None  # NOTE: LoRA turned off: a merge patch keeps what it does not name
    patch.status.update(S.build_status(svc, observed, want, meta.get("generation"), previous, _now(), forbidden,
                                       [str(c) for c in conflicts], pods, adapters))
    if auth is not None:
        patch.status["redisAuthChecksum"] = auth
    if conflicts:
        already = any(c.get("type") == "ChildrenOwned" and c.get("status") == "False" for c in previous)
        if not already:
            kopf.event(body, type="Warning", reason="NameConflict", message="; ".join(map(str, conflicts)))
        raise ChildConflict("; ".join(map(str, conflicts)))


async def _sync_adapters(kube: KubeClient, svc: crd.InferenceService, pods: list[dict[str, Any]], body: Any,
                         config: OperatorConfig, state: lora_sync.SyncState
                         ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """spec.loraAdapters onto the ready engine pods; (status.loraAdapters, AdaptersReady)."""
    done = await lora_sync.sync_adapters(kube, svc, pods, config.metrics_port, state, config.lora_retry_seconds)
    for reason, message in done.actions:
        kopf.event(body, type="Warning" if reason == "LoRAAdapterRefused" else "Normal", reason=reason,
                   message=message)
    return done.statuses, done.condition


async def _engine_pods(kube: KubeClient, svc: crd.InferenceService) -> list[dict[str, Any]]:
    """The engine pods (ModelReady reads their fetch); none when they cannot be listed."""
    try:
        return await kube.list("v1", "Pod", svc.namespace, R.selector_string(svc))
    except KubeError as err:
        log.warning("cannot list the engine pods of %s/%s (ModelReady stays unknown): %s",
                    svc.namespace, svc.name, err)
        return []


async def _running_checksum(kube: KubeClient, svc: crd.InferenceService, status: Any) -> str | None:
    """The Redis password checksum the engine pods run with: their template's, else the status' record.

    NOTE: the template, not only the status: the status is written after the children, so a sync
    right after a roll could read the previous checksum there and roll the pods back.
    """
    engine = await kube.get("apps/v1", "Deployment", svc.namespace, R.engine_name(svc))
    annotations = ((((engine or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
        "annotations") or {}
    return annotations.get(R.REDIS_AUTH_ANNOTATION) or status.get("redisAuthChecksum")


async def _live(kube: KubeClient, svc: crd.InferenceService, uid: str) -> dict[str, Any] | None:
    """The resource as the API server has it now (None: unreadable, gone or another object by that name).

    NOTE: kopf may hand a handler a body older than the operator's last status write (a watch event
    processed late, a handler re-run): its childFingerprints would be missing or stale (every child
    patched again for nothing), and it may not show a deletion under way.
    """
    try:
        live = await kube.get(API_VERSION, KIND, svc.namespace, svc.name)
    except KubeError:
        return None
    if live is None or (live.get("metadata") or {}).get("uid") != uid:
        return None
    return live


async def autoscale_step(kube: KubeClient, svc: crd.InferenceService, body: Any, status: Any, patch: Any,
                         config: OperatorConfig) -> int | None:
    """One autoscaler tick (operator mode): the replicas to run, or None when not autoscaling here."""
    if not (svc.autoscaling.enabled and svc.autoscaling.mode == "operator"):
        return None
    current = R.engine_replicas(svc, status.get("replicas"))
    assert current is not None
    ips = _ready_ips(await kube.list("v1", "Pod", svc.namespace, R.selector_string(svc)))
    waiting = await autoscale.scrape_waiting(ips, config.metrics_port)
    activity = None
    if svc.autoscaling.min_replicas == 0:
        activity = await _activity(kube, svc, ips, waiting, status, patch, config)
    decision = autoscale.decide(svc.autoscaling, current, waiting, _seconds_since(status.get("lastScaleTime")),
                                activity)
    if decision.changed:
        patch.status["lastScaleTime"] = _now()
        kopf.event(body, type="Normal", reason="Scaled", message=decision.reason)
    return decision.replicas


async def _activity(kube: KubeClient, svc: crd.InferenceService, engine_ips: list[str], waiting: list[float],
                    status: Any, patch: Any, config: OperatorConfig) -> autoscale.Activity:
    """Scale to zero's inputs: the routers' held requests, the engines' running ones, the idle time.

    NOTE: the idle clock lives in status (lastActiveTime), so an operator restart does not restart it;
    a service never seen busy starts it at its first tick."""
    router_ips = _ready_ips(await kube.list("v1", "Pod", svc.namespace, R.selector_string(svc, "router")))
    pending = await autoscale.scrape_pending(router_ips, config.router_metrics_port)
    running = await autoscale.scrape_running(engine_ips, config.metrics_port)
    idle = _seconds_since(status.get("lastActiveTime"))
    activity = autoscale.Activity(pending=pending, running=running, idle_seconds=idle or 0.0)
    if idle is None or autoscale.is_active(waiting, activity):
        patch.status["lastActiveTime"] = _now()
        activity = autoscale.Activity(pending=pending, running=running, idle_seconds=0.0)
    return activity


def _ready_ips(pods: list[dict[str, Any]]) -> list[str]:
    return [p["status"]["podIP"] for p in pods if _pod_ready(p) and (p.get("status") or {}).get("podIP")]


def _pod_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


async def redis_ca_bundle(kube: KubeClient, svc: crd.InferenceService) -> str | None:
    """The PEM of `redis.caBundle` (the ConfigMap's or Secret's key, in the service's namespace), or None
    without one; raises when it is configured but cannot be read (the cleanup then retries, then gives up)."""
    ca = svc.redis.ca_bundle
    if ca is None:
        return None
    obj = await kube.get("v1", ca.kind, svc.namespace, ca.name)
    pem = (((obj or {}).get("data") or {}).get(ca.key) if ca.kind == "ConfigMap"
           else redis_auth.password_of(obj, ca.key))
    if not pem:
        raise ValueError(f"redis.caBundle: {ca.kind} {ca.name} has no key {ca.key!r}")
    return pem


async def finalize(kube: KubeClient, svc: crd.InferenceService, body: Any, retry: int,
                   config: OperatorConfig, logger: logging.Logger) -> str:
    """Remove the service's keys from an external Redis; retry a few times, then give up loudly.

    Returns the outcome ("managed", "cleaned", "gave-up"); raises kopf.TemporaryError to retry."""
    if svc.redis.managed:
        logger.info("managed Redis is deleted with the service; no keys to clean")
        return "managed"
    assert svc.redis.url is not None
    try:
        password = None
        if svc.redis.password_secret is not None:
            ref = svc.redis.password_secret
            secret = await kube.get("v1", "Secret", svc.namespace, ref.name)
            raw = ((secret or {}).get("data") or {}).get(ref.key)
            password = base64.b64decode(raw).decode() if raw else None
        ca = await redis_ca_bundle(kube, svc)
        deleted = await asyncio.to_thread(redis_cleanup.cleanup, svc.redis.url, password, svc.namespace, svc.name,
                                          ca)
    except Exception as err:  # noqa: BLE001 - any Redis or API failure is retried the same way
        if retry + 1 < config.cleanup_retries:
            raise kopf.TemporaryError(f"Redis cleanup failed ({err}); retrying", delay=config.cleanup_delay_seconds)
        kopf.event(body, type="Warning", reason="RedisCleanupFailed",
                  message=f"gave up removing keys {KeySpace(svc.namespace, svc.name).prefix}* "
                          f"after {retry + 1} attempts: {err}")
        return "gave-up"
    kopf.event(body, type="Normal", reason="RedisCleaned", message=f"deleted {deleted} Redis keys")
    return "cleaned"


async def note_secret_change(kube: KubeClient, event_type: str | None, secret: Any, namespace: str) -> bool:
    """A Secret the operator owns changed: mark its InferenceService so kopf re-runs the reconcile.

    The reconcile recreates a deleted password Secret and rolls the pods onto a changed password
    (the checksum on the pod templates). Returns whether the InferenceService was marked; it is not
    when the change is the one the pods already run with (the operator's own create, the first list).
    """
    owner = redis_auth.owner_name(secret, KIND, API_VERSION)
    if owner is None or (secret.get("metadata") or {}).get("name") != f"{owner}-redis-auth":
        return False
    value = ("deleted" if event_type == "DELETED"
             else redis_auth.secret_checksum(secret, R.REDIS_PASSWORD_KEY) or "unreadable")
    cr = await kube.get(API_VERSION, KIND, namespace, owner)
    if cr is None or (cr.get("metadata") or {}).get("deletionTimestamp"):
        return False
    annotations = (cr.get("metadata") or {}).get("annotations") or {}
    if value == (cr.get("status") or {}).get("redisAuthChecksum") or value == annotations.get(
            redis_auth.TRIGGER_ANNOTATION):
        return False
    await kube.merge_patch(API_VERSION, KIND, namespace, owner,
                           {"metadata": {"annotations": {redis_auth.TRIGGER_ANNOTATION: value}}})
    log.info("Secret %s/%s %s: reconciling InferenceService %s", namespace, secret["metadata"]["name"],
             "deleted" if value == "deleted" else "changed", owner)
    return True


def make_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    """A fresh registry with every handler; no module-level state, so tests can run many operators."""
    registry = kopf.OperatorRegistry()
    on = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvmesh.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvmesh.io", key="last-handled-configuration")
        # NOTE: Events come from explicit kopf.event calls, not from every log line.
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    @kopf.on.login(registry=registry)
    def login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            memo.kube = KubeClient(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(memo: Any, **_: Any) -> None:
        if getattr(memo, "kube", None) is not None:
            await memo.kube.close()

    # NOTE: explicit ids: kopf stores progress in annotations named after them.
    @kopf.on.resume(**on, id="reconcile")
    @kopf.on.create(**on, id="reconcile")
    @kopf.on.update(**on, id="reconcile", field="spec")
    # a Secret the operator owns changed or went (the Secret watch marks the resource)
    @kopf.on.update(**on, id="redis-auth", field=("metadata", "annotations", redis_auth.TRIGGER_ANNOTATION))
    async def reconcile(name: str, namespace: str, uid: str, spec: Any, body: Any, meta: Any, status: Any,
                        patch: kopf.Patch, memo: Any, **_: Any) -> None:
        svc = _parse(name, namespace, spec, body, patch, status, meta)
        autoscaled = status.get("replicas") if svc.autoscaling.enabled else None
        try:
            await sync(_kube(memo), svc, uid, body, meta, status, patch, autoscaled, _warned(memo),
                       config.operator_namespace, config=config, lora_state=_lora_state(memo, uid))
        except ChildConflict as err:  # shown in status; retried when the spec changes (and by resync)
            raise kopf.PermanentError(str(err)) from err

    @kopf.timer(**on, id="resync", interval=config.resync_seconds, initial_delay=config.resync_seconds)
    async def resync(name: str, namespace: str, uid: str, spec: Any, body: Any, meta: Any, status: Any,
                     patch: kopf.Patch, memo: Any, **_: Any) -> None:
        if meta.get("deletionTimestamp"):
            # NOTE: being deleted: recreating children the garbage collector removes, or writing a
            # status over "Terminating", would only fight the finalizer.
            return
        try:
            svc = crd.parse(name, namespace, dict(spec or {}))
        except crd.SpecError:
            return  # the change handler already reported it; nothing to repair
        kube = _kube(memo)
        autoscaled = await autoscale_step(kube, svc, body, status, patch, config)
        if autoscaled is None and svc.autoscaling.enabled:
            autoscaled = status.get("replicas")
        with contextlib.suppress(ChildConflict):  # already in status; looked at again next tick
            await sync(kube, svc, uid, body, meta, status, patch, autoscaled, _warned(memo),
                       config.operator_namespace, full_sweep=False, config=config, lora_state=_lora_state(memo, uid))

    if config.watch_secrets:
        # NOTE: only Secrets labelled as the operator's (the managed Redis' passwords); needs list/watch
        # on Secrets (chart: rbac.readSecrets), so it is opt-in. Without it the resync notices within
        # --resync-seconds (a deleted password Secret is recreated; a rotated one read when allowed).
        @kopf.on.event("v1", "secrets", labels={"app.kubernetes.io/managed-by": R.MANAGED_BY},
                       registry=registry, id="redis-auth-watch")
        async def secret_event(event: Any, body: Any, namespace: str, memo: Any, **_: Any) -> None:
            await note_secret_change(_kube(memo), (event or {}).get("type"), body, namespace)

    @kopf.on.delete(**on, id="redis-cleanup")
    async def delete(name: str, namespace: str, uid: str, spec: Any, body: Any, retry: int, memo: Any,
                     patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
        patch.status["phase"] = "Terminating"
        (getattr(memo, "lora_states", None) or {}).pop(uid, None)
        try:
            svc = crd.parse(name, namespace, dict(spec or {}))
        except crd.SpecError:
            return  # nothing was ever created
        kube = _kube(memo)
        # NOTE: a late watch event can replay the deletion of a resource already released: clean once.
        live = await kube.get(API_VERSION, KIND, namespace, name)
        if live is None or (live.get("metadata") or {}).get("uid") != uid or FINALIZER not in (
                (live.get("metadata") or {}).get("finalizers") or []):
            logger.info("already released; nothing to clean")
            return
        done = _finalized(memo).get(uid)
        if done is not None:
            logger.info("the cleanup of this deletion already ended (%s); releasing", done)
            return
        _remember_finalized(memo, uid, await finalize(kube, svc, body, retry, config, logger))

    return registry
