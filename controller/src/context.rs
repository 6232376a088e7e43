//! State shared by the reconcilers, their error type and small helpers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::OwnedMutexGuard;

use crate::metrics::Metrics;
use crate::sandbox::{LocateError, SandboxLocator};
use crate::shim::{NodeService, ShimError, TwigShim};

/// `reportingController` of the controller's Events.
pub const CONTROLLER_NAME: &str = "twig.dev/controller";

/// A reconciler failure; the object is retried after a per-object
/// exponential backoff (see [`Backoff`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A call to the Kubernetes API failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A call to the shim or the node service failed.
    #[error("node service: {0}")]
    Shim(#[from] ShimError),
    /// The pod's sandbox could not be found on this node.
    #[error("finding the pod's sandbox: {0}")]
    Locate(#[from] LocateError),
    /// The object lacks a field the reconciler needs.
    #[error("object has no {0}")]
    MissingField(&'static str),
    /// An object could not be encoded as JSON.
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Adding or removing a finalizer, or the work done under it, failed.
    #[error("{0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl From<kube::runtime::finalizer::Error<Error>> for Error {
    fn from(e: kube::runtime::finalizer::Error<Error>) -> Self {
        Self::Finalizer(Box::new(e))
    }
}

/// Per-object exponential backoff of failed reconciles: the first retry
/// after `start`, each further one `factor` times later, at most `cap`; a
/// successful reconcile of the object resets it.
pub struct Backoff {
    /// Delay before the first retry.
    pub start: Duration,
    /// Growth of the delay per consecutive failure.
    pub factor: u32,
    /// Longest delay.
    pub cap: Duration,
    failures: Mutex<HashMap<String, u32>>,
}

impl Backoff {
    /// A backoff from `start`, doubling, capped at `cap`.
    pub fn new(start: Duration, cap: Duration) -> Self {
        Self {
            start,
            factor: 2,
            cap,
            failures: Mutex::default(),
        }
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records one more failure of `key` and returns the delay before its retry.
    pub fn failed(&self, key: &str) -> Duration {
        let mut failures = self.failures();
        let n = failures.entry(key.to_string()).or_default();
        let delay = self
            .factor
            .checked_pow(*n)
            .and_then(|f| self.start.checked_mul(f))
            .map_or(self.cap, |d| d.min(self.cap));
        *n = n.saturating_add(1);
        delay
    }

    /// Forgets the failures of `key` (it reconciled successfully).
    pub fn succeeded(&self, key: &str) {
        self.failures().remove(key);
    }

    /// Consecutive failures of `key` so far.
    pub fn failure_count(&self, key: &str) -> u32 {
        self.failures().get(key).copied().unwrap_or_default()
    }
}

/// Longest field manager name the API server accepts.
const MAX_FIELD_MANAGER: usize = 128;
/// Longest name part of a qualified name (a finalizer's after the `/`).
const MAX_NAME_PART: usize = 63;

/// `prefix` + `node`, at most `max` characters: a name that does not fit
/// keeps its start and ends with a hash of the whole, so it stays unique.
pub(crate) fn bounded_name(prefix: &str, node: &str, max: usize) -> String {
    let full = format!("{prefix}{node}");
    if full.len() <= max {
        return full;
    }
    // FNV-1a: stable across releases and platforms (std's hasher is not).
    let hash = full.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let suffix = format!("-{hash:016x}");
    let keep = full
        .char_indices()
        .map(|(i, _)| i)
        .take_while(|i| *i + suffix.len() <= max)
        .last()
        .unwrap_or(0);
    let head = full[..keep].trim_end_matches(['-', '.']);
    format!("{head}{suffix}")
}

/// Namespace and name of a pod.
type PodKey = (String, String);

/// The OCI registry Snapshots are exported to (`--registry`,
/// `--registry-prefix`): a Snapshot `name` of namespace `ns` goes to
/// repository `<host>/<prefix>/<ns>/<name>`, the repositories twig-node
/// lets that namespace write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registry {
    /// `host[:port]`, without a scheme.
    pub host: String,
    /// The first path component(s) of every repository (default `twig`).
    pub prefix: String,
}

impl Registry {
    /// A registry target, checked: `host` a `host[:port]` (no scheme, no
    /// path), `prefix` lowercase repository path components (slashes at
    /// its ends dropped).
    pub fn new(host: &str, prefix: &str) -> Result<Registry, String> {
        let host_ok = !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
        if !host_ok {
            return Err(format!(
                "registry {host:?} is not a host[:port] (no scheme, no path)"
            ));
        }
        let prefix = prefix.trim_matches('/');
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.starts_with(|ch: char| ch.is_ascii_lowercase() || ch.is_ascii_digit())
                && c.ends_with(|ch: char| ch.is_ascii_lowercase() || ch.is_ascii_digit())
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        };
        if !prefix.split('/').all(component_ok) {
            return Err(format!(
                "registry prefix {prefix:?} is not a repository path (lowercase alphanumerics, '.', '_', '-', components joined by '/')"
            ));
        }
        Ok(Registry {
            host: host.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// The repository of Snapshot `name` in namespace `namespace`.
    pub fn repository(&self, namespace: &str, name: &str) -> String {
        format!("{}/{}/{namespace}/{name}", self.host, self.prefix)
    }
}

/// Everything a reconciler needs; one per controller process (one per node).
pub struct Context {
    /// Client of the Kubernetes API.
    pub client: Client,
    /// The node this controller serves (from the downward API).
    pub node_name: String,
    /// Field manager of this node's server-side applies: `twig-controller/<node>`.
    pub field_manager: String,
    /// Finds a pod's sandbox (and its shim) on this node.
    pub locator: Arc<dyn SandboxLocator>,
    /// The shims of this node's sandboxes.
    pub shim: Arc<dyn TwigShim>,
    /// This node's node service (node store, templates).
    pub node: Arc<dyn NodeService>,
    /// Operation metrics.
    pub metrics: Arc<Metrics>,
    /// Delay before an object waiting on something else is looked at again.
    pub retry: Duration,
    /// How often a Ready snapshot's data is checked to still be on the node.
    pub recheck: Duration,
    /// How often a deleting object whose finalizer belongs to another node
    /// is checked for that node's Node object being gone.
    pub orphan_check: Duration,
    /// How often a pod's network path is read again (its policy in force
    /// checked, its counters refreshed for `/metrics`).
    pub network_refresh: Duration,
    /// How often the node store's usage is read again for `/metrics`.
    pub store_refresh: Duration,
    /// How often the node store's garbage is collected.
    pub gc_every: Duration,
    /// How old a snapshot nothing refers to must be to be collected.
    pub gc_grace: Duration,
    /// Delays of retries after failed reconciles.
    pub backoff: Backoff,
    /// Where Snapshots with `spec.export` go; `None`: no registry configured.
    pub registry: Option<Registry>,
    recorder: Recorder,
    /// The last Warning Event published about each pod, so a condition that
    /// lasts is not repeated on every look.
    pod_warnings: Mutex<HashMap<PodKey, String>>,
    pod_locks: Mutex<HashMap<PodKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl Context {
    /// A context for the controller of `node_name`, with default delays
    /// (retry 5 s, recheck 5 min, orphan check 1 min, network refresh 15 s,
    /// store refresh 30 s, garbage collection every 10 min with 10 min of
    /// grace, backoff 1 s ×2 up to 5 min).
    pub fn new(
        client: Client,
        node_name: String,
        locator: Arc<dyn SandboxLocator>,
        shim: Arc<dyn TwigShim>,
        node: Arc<dyn NodeService>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.to_string(),
            instance: Some(node_name.clone()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            field_manager: bounded_name("twig-controller/", &node_name, MAX_FIELD_MANAGER),
            node_name,
            locator,
            shim,
            node,
            metrics,
            retry: Duration::from_secs(5),
            recheck: Duration::from_secs(300),
            orphan_check: Duration::from_secs(60),
            network_refresh: Duration::from_secs(15),
            store_refresh: Duration::from_secs(30),
            gc_every: Duration::from_secs(600),
            gc_grace: Duration::from_secs(600),
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(300)),
            registry: None,
            pod_locks: Mutex::default(),
            pod_warnings: Mutex::default(),
        }
    }

    /// Sets the delay before waiting objects are looked at again.
    #[must_use]
    pub fn with_retry(mut self, retry: Duration) -> Self {
        self.retry = retry;
        self
    }

    /// Sets how often Ready snapshots are checked to still be on the node.
    #[must_use]
    pub fn with_recheck(mut self, recheck: Duration) -> Self {
        self.recheck = recheck;
        self
    }

    /// Sets how often other nodes' deleting objects are checked for their node being gone.
    #[must_use]
    pub fn with_orphan_check(mut self, every: Duration) -> Self {
        self.orphan_check = every;
        self
    }

    /// Sets how often pods' network paths are read again.
    #[must_use]
    pub fn with_network_refresh(mut self, every: Duration) -> Self {
        self.network_refresh = every;
        self
    }

    /// Sets how often the node store's usage is read again for `/metrics`.
    #[must_use]
    pub fn with_store_refresh(mut self, every: Duration) -> Self {
        self.store_refresh = every;
        self
    }

    /// Sets how often the node store's garbage is collected, and how old a
    /// snapshot nothing refers to must be to go.
    #[must_use]
    pub fn with_gc(mut self, every: Duration, grace: Duration) -> Self {
        self.gc_every = every;
        self.gc_grace = grace;
        self
    }

    /// Sets the backoff of failed reconciles: first retry after `start`, doubling up to `cap`.
    #[must_use]
    pub fn with_backoff(mut self, start: Duration, cap: Duration) -> Self {
        self.backoff = Backoff::new(start, cap);
        self
    }

    /// Sets the registry Snapshots with `spec.export` are pushed to.
    #[must_use]
    pub fn with_registry(mut self, registry: Registry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// This node's finalizer on SandboxTemplates: `twig.dev/template.<node>`.
    pub fn template_finalizer(&self) -> String {
        template_finalizer(&self.node_name)
    }

    /// Does the Node object `name` still exist?
    pub(crate) async fn node_exists(&self, name: &str) -> Result<bool, Error> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        Ok(nodes.get_opt(name).await?.is_some())
    }

    /// Serializes operations on one pod: held across every shim call on it.
    pub(crate) async fn lock_pod(&self, namespace: &str, pod: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self
                .pod_locks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Forget locks nobody holds or waits for, so the map stays as small as the work in flight.
            locks.retain(|_, l| Arc::strong_count(l) > 1);
            locks
                .entry((namespace.to_string(), pod.to_string()))
                .or_default()
                .clone()
        };
        lock.lock_owned().await
    }

    /// Publishes a Kubernetes Event about `obj`; a failure to publish is logged, not fatal.
    pub(crate) async fn event<K>(
        &self,
        obj: &K,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) where
        K: Resource<DynamicType = ()>,
    {
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note),
            action: action.to_string(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &obj.object_ref(&())).await {
            tracing::warn!(object = %obj.name_any(), reason, error = %e, "cannot publish event");
        }
    }
}

impl Context {
    fn pod_warnings(&self) -> std::sync::MutexGuard<'_, HashMap<PodKey, String>> {
        self.pod_warnings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Publishes a Warning Event about `pod`, unless the last one published
    /// about it had the same reason and note.
    pub(crate) async fn warn_pod_once(&self, pod: &Pod, reason: &str, action: &str, note: String) {
        let key = (pod.namespace().unwrap_or_default(), pod.name_any());
        let said = format!("{reason}: {note}");
        if self.pod_warnings().get(&key) == Some(&said) {
            return;
        }
        self.event(pod, EventType::Warning, reason, action, note)
            .await;
        self.pod_warnings().insert(key, said);
    }

    /// Forgets the last warning about a pod (what it warned of is over).
    pub(crate) fn clear_pod_warning(&self, namespace: &str, pod: &str) {
        self.pod_warnings()
            .remove(&(namespace.to_string(), pod.to_string()));
    }

    /// Forgets the warnings about pods `keep(namespace, name)` is false for.
    pub(crate) fn retain_pod_warnings(&self, mut keep: impl FnMut(&str, &str) -> bool) {
        self.pod_warnings().retain(|(ns, name), _| keep(ns, name));
    }
}

/// The current time as a Kubernetes `Time`.
pub(crate) fn now() -> Time {
    Time(Timestamp::now())
}

/// Milliseconds from `since` until now (0 if `since` is in the future or unknown).
pub(crate) fn millis_since(since: Option<&Time>) -> u64 {
    since
        .map(|t| {
            let ms = Timestamp::now().as_millisecond() - t.0.as_millisecond();
            u64::try_from(ms).unwrap_or(0)
        })
        .unwrap_or(0)
}

/// The SandboxTemplate finalizer of `node`: `twig.dev/template.<node>`
/// (shortened with a hash when the node's name is long).
pub fn template_finalizer(node: &str) -> String {
    let name = bounded_name("template.", node, MAX_NAME_PART);
    format!("{}/{name}", crate::crd::GROUP)
}

/// Is this a 404 from the API server?
pub(crate) fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(e) if e.code == 404)
}

#[cfg(test)]
mod tests {
    use super::Registry;

    #[test]
    fn registries_are_hosts_and_prefixes_are_repository_paths() {
        let r = Registry::new("registry.example:5000", "/twig/snapshots/").expect("valid");
        assert_eq!(r.prefix, "twig/snapshots");
        assert_eq!(
            r.repository("team-a", "redis"),
            "registry.example:5000/twig/snapshots/team-a/redis"
        );
        assert!(Registry::new("[::1]:5000", "twig").is_ok());
        for host in ["", "https://registry.example", "registry.example/path"] {
            let err = Registry::new(host, "twig").expect_err(host);
            assert!(err.contains("host[:port]"), "{err}");
        }
        for prefix in ["", "Twig", "twig//x", "-twig", "twig_"] {
            let err = Registry::new("registry.example", prefix).expect_err(prefix);
            assert!(err.contains("repository path"), "{err}");
        }
    }
}
