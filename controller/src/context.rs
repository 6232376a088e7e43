//! State shared by the reconcilers, their error type and small helpers.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::OwnedMutexGuard;

use crate::metrics::Metrics;
use crate::sandbox::{LocateError, SandboxLocator};
use crate::shim::{NodeService, ShimError, TwigShim};

/// `reportingController` of the controller's Events.
pub const CONTROLLER_NAME: &str = "twig.dev/controller";

/// A reconciler failure; the object is retried after [`Context::retry`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("node service: {0}")]
    Shim(#[from] ShimError),
    #[error("finding the pod's sandbox: {0}")]
    Locate(#[from] LocateError),
    #[error("object has no {0}")]
    MissingField(&'static str),
}

/// Namespace and name of a pod.
type PodKey = (String, String);

/// Everything a reconciler needs; one per controller process (one per node).
pub struct Context {
    pub client: Client,
    /// The node this controller serves (from the downward API).
    pub node_name: String,
    pub locator: Arc<dyn SandboxLocator>,
    pub shim: Arc<dyn TwigShim>,
    pub node: Arc<dyn NodeService>,
    pub metrics: Arc<Metrics>,
    /// Delay before an object waiting on something else, or after an error, is looked at again.
    pub retry: Duration,
    /// How often a Ready snapshot's data is checked to still be on the node.
    pub recheck: Duration,
    recorder: Recorder,
    pod_locks: Mutex<HashMap<PodKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl Context {
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
            node_name,
            locator,
            shim,
            node,
            metrics,
            retry: Duration::from_secs(5),
            recheck: Duration::from_secs(300),
            pod_locks: Mutex::default(),
        }
    }

    /// Sets the delay before waiting or failed objects are retried.
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

/// Adds `finalizer` to the object (optimistically, against its resourceVersion).
pub(crate) async fn add_finalizer<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<K, Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    if obj.finalizers().iter().any(|f| f == finalizer) {
        return Ok(obj.clone());
    }
    let mut new = obj.clone();
    new.finalizers_mut().push(finalizer.to_string());
    Ok(api
        .replace(&obj.name_any(), &PostParams::default(), &new)
        .await?)
}

/// Removes `finalizer` from the object (optimistically, against its resourceVersion).
pub(crate) async fn remove_finalizer<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    if !obj.finalizers().iter().any(|f| f == finalizer) {
        return Ok(());
    }
    let mut new = obj.clone();
    new.finalizers_mut().retain(|f| f != finalizer);
    match api
        .replace(&obj.name_any(), &PostParams::default(), &new)
        .await
    {
        Ok(_) => Ok(()),
        // Removing the last finalizer of a deleted object deletes it; a 404 means it is already gone.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Is this a 404 from the API server?
pub(crate) fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(e) if e.code == 404)
}
