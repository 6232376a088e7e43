//! How a sandbox is kept in Kubernetes objects: the labels and annotations
//! twig-api writes on pods, Clones and Snapshots, and the objects it makes.
//!
//! - A **running** sandbox is a pod labelled `twig.dev/sandbox=<id>`: made
//!   from a SandboxTemplate (`twig.dev/template`), or by a Clone (from a
//!   snapshot, a fork, or a resume).
//! - A **paused** sandbox is a Snapshot labelled with its ID and the role
//!   `pause`, and no pod.
//! - What the API reports (template, times, metadata, size) is in the
//!   `twig.dev/sandbox-*` annotations and `meta.twig.dev/*` labels of those
//!   objects, copied from one to the next.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use kube::api::ObjectMeta;
use ring::rand::{SecureRandom, SystemRandom};
use twig_controller::crd::{
    CloneSource, CloneSpec, PodClone, SandboxTemplate, Snapshot, SnapshotMode, SnapshotSpec,
    EGRESS_POLICY_ANNOTATION, ENVD_ANNOTATION, ENVD_ON, ENVD_TOKEN_SHA256_ANNOTATION,
    RUNTIME_CLASS, TEMPLATE_ANNOTATION,
};

use crate::error::ApiError;

/// Label with the sandbox's ID: on its pod, its Clones and its pause Snapshots.
pub const SANDBOX_LABEL: &str = "twig.dev/sandbox";
/// Label of a Snapshot twig-api made, saying why: [`ROLE_PAUSE`],
/// [`ROLE_FORK`] or [`ROLE_SNAPSHOT`].
pub const ROLE_LABEL: &str = "twig.dev/sandbox-role";
/// A paused sandbox's state.
pub const ROLE_PAUSE: &str = "pause";
/// The state a fork's sandboxes start from.
pub const ROLE_FORK: &str = "fork";
/// A snapshot a user asked for: a template ID sandboxes can be created from.
pub const ROLE_SNAPSHOT: &str = "snapshot";
/// Label of a fork or user Snapshot: the sandbox it was taken of.
pub const SNAPSHOT_OF_LABEL: &str = "twig.dev/snapshot-of";
/// Prefix of the labels holding a sandbox's metadata.
pub const METADATA_PREFIX: &str = "meta.twig.dev/";

/// The template ID the sandbox was created with.
pub const TEMPLATE_ID_ANNOTATION: &str = "twig.dev/sandbox-template";
/// When the sandbox started (RFC 3339).
pub const STARTED_ANNOTATION: &str = "twig.dev/sandbox-started";
/// When the sandbox times out (RFC 3339); absent: never.
pub const END_ANNOTATION: &str = "twig.dev/sandbox-end";
/// `pause`: the timeout pauses the sandbox instead of killing it.
pub const ON_TIMEOUT_ANNOTATION: &str = "twig.dev/sandbox-on-timeout";
/// The sandbox's vCPUs.
pub const CPUS_ANNOTATION: &str = "twig.dev/sandbox-cpus";
/// The sandbox's memory, in MiB.
pub const MEMORY_ANNOTATION: &str = "twig.dev/sandbox-memory-mib";
/// `false`: ports other than envd's need the traffic access token.
pub const PUBLIC_TRAFFIC_ANNOTATION: &str = "twig.dev/sandbox-public-traffic";
/// The names a user snapshot was given (JSON array).
pub const SNAPSHOT_NAMES_ANNOTATION: &str = "twig.dev/snapshot-names";

/// The annotations that travel with a sandbox from object to object.
pub const SANDBOX_ANNOTATIONS: [&str; 7] = [
    TEMPLATE_ID_ANNOTATION,
    PUBLIC_TRAFFIC_ANNOTATION,
    STARTED_ANNOTATION,
    END_ANNOTATION,
    ON_TIMEOUT_ANNOTATION,
    CPUS_ANNOTATION,
    MEMORY_ANNOTATION,
];

/// The container a template sandbox's pod runs (its template's process).
pub const CONTAINER: &str = "sandbox";

/// A new ID: a letter then 19 of `[a-z0-9]` (a DNS label, as E2B's IDs are).
pub fn new_id(first: char) -> Result<String, ApiError> {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut bytes = [0u8; 19];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| ApiError::internal("no random bytes from the system"))?;
    let mut id = String::with_capacity(20);
    id.push(first);
    id.extend(
        bytes
            .iter()
            .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()])),
    );
    Ok(id)
}

/// A short, increasing suffix for the objects of one sandbox (base-36
/// milliseconds since the epoch).
pub fn generation() -> String {
    let mut n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    let mut out = Vec::new();
    while n > 0 {
        let digit = u8::try_from(n % 36).unwrap_or_default();
        out.push(char::from(if digit < 10 {
            b'0' + digit
        } else {
            b'a' + digit - 10
        }));
        n /= 36;
    }
    out.iter().rev().collect()
}

/// Checks a sandbox or snapshot ID from a URL or body: a DNS label, so it
/// can never name anything but an object of the caller's namespace.
pub fn check_id(what: &str, id: &str) -> Result<(), ApiError> {
    if crate::auth::is_dns_label(id) {
        Ok(())
    } else {
        Err(ApiError::not_found(format!("{what} '{id}' not found")))
    }
}

fn label_part_ok(s: &str, max: usize) -> bool {
    s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
}

/// The labels holding `metadata`; each key and value must fit a Kubernetes
/// label (keys 1–63 and values 0–63 of `[A-Za-z0-9._-]`, alphanumeric at
/// both ends).
pub fn metadata_labels(
    metadata: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, ApiError> {
    let mut labels = BTreeMap::new();
    for (key, value) in metadata {
        if key.is_empty() || !label_part_ok(key, 63) {
            return Err(ApiError::bad_request(format!(
                "metadata key {key:?}: Twig keeps metadata as Kubernetes labels, so a key is 1-63 characters of [A-Za-z0-9._-], alphanumeric at both ends"
            )));
        }
        if !label_part_ok(value, 63) {
            return Err(ApiError::bad_request(format!(
                "metadata value {value:?} of {key:?}: Twig keeps metadata as Kubernetes labels, so a value is at most 63 characters of [A-Za-z0-9._-], alphanumeric at both ends"
            )));
        }
        labels.insert(format!("{METADATA_PREFIX}{key}"), value.clone());
    }
    Ok(labels)
}

/// The metadata kept in `labels`.
pub fn metadata_of(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix(METADATA_PREFIX)
                .map(|key| (key.to_string(), v.clone()))
        })
        .collect()
}

/// The labels and annotations of one sandbox that its objects carry.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SandboxMeta {
    /// `twig.dev/sandbox` and the metadata labels.
    pub labels: BTreeMap<String, String>,
    /// The `twig.dev/sandbox-*` annotations.
    pub annotations: BTreeMap<String, String>,
}

impl SandboxMeta {
    /// What an object of sandbox `id` carries of it.
    pub fn of(meta: &ObjectMeta) -> Self {
        let labels = meta
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| k.as_str() == SANDBOX_LABEL || k.starts_with(METADATA_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let annotations = meta
            .annotations
            .iter()
            .flatten()
            .filter(|(k, _)| SANDBOX_ANNOTATIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self {
            labels,
            annotations,
        }
    }

    /// The same sandbox's meta under another ID (a fork).
    pub fn with_id(&self, id: &str) -> Self {
        let mut next = self.clone();
        next.labels
            .insert(SANDBOX_LABEL.to_string(), id.to_string());
        next
    }
}

/// The pod of a new sandbox `id` from `template`, with the sandbox API
/// on and requiring, from its first request, the access token whose
/// SHA-256 is `envd_token_sha256` (hex): nobody reaches it before twig-api
/// calls `/init`.
pub fn template_pod(
    id: &str,
    template: &SandboxTemplate,
    meta: &SandboxMeta,
    env: &BTreeMap<String, String>,
    egress_policy: Option<String>,
    envd_token_sha256: String,
) -> Pod {
    let mut annotations = meta.annotations.clone();
    annotations.insert(TEMPLATE_ANNOTATION.to_string(), template_name(template));
    annotations.insert(ENVD_ANNOTATION.to_string(), ENVD_ON.to_string());
    annotations.insert(ENVD_TOKEN_SHA256_ANNOTATION.to_string(), envd_token_sha256);
    if let Some(policy) = egress_policy {
        annotations.insert(EGRESS_POLICY_ANNOTATION.to_string(), policy);
    }
    let env: Vec<EnvVar> = env
        .iter()
        .map(|(name, value)| EnvVar {
            name: name.clone(),
            value: Some(value.clone()),
            value_from: None,
        })
        .collect();
    Pod {
        metadata: ObjectMeta {
            name: Some(id.to_string()),
            labels: Some(meta.labels.clone()),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(PodSpec {
            runtime_class_name: Some(RUNTIME_CLASS.to_string()),
            restart_policy: Some("Never".to_string()),
            // A sandbox runs an agent's code: no credentials to the cluster,
            // and no Service environment baked into its memory.
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            containers: vec![Container {
                name: CONTAINER.to_string(),
                image: Some(template.spec.image.clone()),
                command: template.spec.command.clone(),
                env: (!env.is_empty()).then_some(env),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}

fn template_name(template: &SandboxTemplate) -> String {
    template.metadata.name.clone().unwrap_or_default()
}

/// A Snapshot of sandbox `id`'s pod `pod`, taken for `role`, failed by the
/// controller after `deadline` (the API's own wait for it).
pub fn snapshot(
    name: &str,
    pod: &str,
    role: &str,
    id: &str,
    meta: &SandboxMeta,
    extra: BTreeMap<String, String>,
    deadline: Duration,
) -> Snapshot {
    let mut labels = BTreeMap::from([(ROLE_LABEL.to_string(), role.to_string())]);
    let mut annotations = extra;
    if role == ROLE_PAUSE {
        // A paused sandbox is its pause Snapshot: it carries the sandbox.
        labels.extend(meta.labels.clone());
        annotations.extend(meta.annotations.clone());
    } else {
        labels.insert(SNAPSHOT_OF_LABEL.to_string(), id.to_string());
    }
    let mut snap = Snapshot::new(
        name,
        SnapshotSpec {
            pod_name: pod.to_string(),
            pod_uid: None,
            // A pause or fork Snapshot stands alone: its pod goes, and
            // so can any earlier one.
            mode: if role == ROLE_SNAPSHOT {
                SnapshotMode::Incremental
            } else {
                SnapshotMode::Full
            },
            deletion_policy: Default::default(),
            ttl_seconds_after_ready: None,
            failure_deadline_seconds: Some(deadline_seconds(deadline)),
            export: false,
        },
    );
    snap.metadata.labels = Some(labels);
    snap.metadata.annotations = Some(annotations);
    snap
}

/// A Clone making sandbox `meta`'s pod from Snapshot `snapshot`: the pod
/// is named `<name>-0`; failed by the controller after `deadline` (the
/// API's own wait for it).
pub fn clone(name: &str, snapshot: &str, meta: &SandboxMeta, deadline: Duration) -> PodClone {
    let mut clone = PodClone::new(
        name,
        CloneSpec {
            source: CloneSource {
                snapshot_name: Some(snapshot.to_string()),
                pod_name: None,
            },
            replicas: 1,
            name_prefix: None,
            labels: Some(meta.labels.clone()),
            failure_deadline_seconds: Some(deadline_seconds(deadline)),
        },
    );
    clone.metadata.labels = Some(meta.labels.clone());
    clone.metadata.annotations = Some(meta.annotations.clone());
    clone
}

/// An object's `failureDeadlineSeconds` for a wait of `deadline`: the
/// object fails when the API stops waiting for it, neither earlier (a
/// loaded node's start would fail although the API still waits) nor later.
pub fn deadline_seconds(deadline: Duration) -> i64 {
    i64::try_from(deadline.as_secs().max(1)).unwrap_or(i64::MAX)
}

/// The name of the one pod of Clone `name`.
pub fn clone_pod_name(name: &str) -> String {
    format!("{name}-0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_dns_labels_and_differ() {
        let a = new_id('i').expect("id");
        let b = new_id('i').expect("id");
        assert_eq!(a.len(), 20);
        assert!(crate::auth::is_dns_label(&a));
        assert_ne!(a, b);
        assert!(check_id("sandbox", "../other").is_err());
        assert!(check_id("sandbox", "Team").is_err());
    }

    #[test]
    fn metadata_round_trips_through_labels_and_bad_keys_are_refused() {
        let md = BTreeMap::from([("user".to_string(), "a-1".to_string())]);
        let labels = metadata_labels(&md).expect("labels");
        assert_eq!(
            labels.get("meta.twig.dev/user").map(String::as_str),
            Some("a-1")
        );
        assert_eq!(metadata_of(&labels), md);
        let bad = BTreeMap::from([("a b".to_string(), "x".to_string())]);
        assert_eq!(metadata_labels(&bad).unwrap_err().status, 400);
        let long = BTreeMap::from([("k".to_string(), "x".repeat(64))]);
        assert_eq!(metadata_labels(&long).unwrap_err().status, 400);
    }

    #[test]
    fn generations_increase() {
        let a = generation();
        let b = generation();
        assert_eq!(a.len(), b.len());
        assert!(a <= b, "{a} then {b}");
    }
}
