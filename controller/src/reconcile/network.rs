//! The network path of this node's Twig pods: keeps each running pod's
//! egress policy in force equal to its effective policy (its
//! SandboxTemplate's `spec.egressPolicy`, else the built-in default,
//! narrowed — never widened — by its `twig.dev/egress-policy` annotation:
//! twig-net's `bounded_policy`), and mirrors the path's counters into
//! `/metrics`.
//!
//! Level-triggered: every look reads the shim's `Stats` (the policy in force
//! and the counters) and calls `SetEgressPolicy` only when the policy in
//! force differs. A pod is looked at when it changes, when a
//! SandboxTemplate's policy changes (every pod of the node: the reconciler
//! resolves which template each pod names), and every `network_refresh`.

use std::collections::HashMap;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use twig_net::{bounded_policy, effective_policy, parse_policy, EgressPolicy};

use super::{backoff_key, drain, error_policy};
use crate::context::{Context, Error};
use crate::crd::{SandboxTemplate, EGRESS_POLICY_ANNOTATION, RUNTIME_CLASS, TEMPLATE_ANNOTATION};
use crate::sandbox::LocateError;
use crate::shim::ShimError;

/// Reason of the Normal Event on a pod whose policy in force was replaced.
pub const UPDATED: &str = "EgressPolicyUpdated";
/// Reason of the Warning Event on a pod whose effective policy is malformed
/// (its annotation, or its template's policy): nothing is sent.
pub const INVALID: &str = "InvalidEgressPolicy";
/// Reason of the Warning Event on a pod whose SandboxTemplate is gone: the
/// policy in force is kept.
pub const TEMPLATE_NOT_FOUND: &str = "TemplateNotFound";
/// Reason of the Warning Event on a pod whose shim refused or failed the
/// new policy: it is retried with backoff.
pub const FAILED: &str = "EgressPolicyFailed";
/// Reason of the Warning Event on a pod whose annotation reaches past its
/// SandboxTemplate's (or the cluster's default) policy: it runs with the
/// part both allow, and the note names each clipped field.
pub const CLIPPED: &str = "EgressPolicyClipped";

const ACTION: &str = "EgressPolicy";

/// The policy a pod should run with, and where it comes from.
enum Wanted {
    /// Set this policy (`None`: the built-in default); the text says where
    /// it comes from; the fields of the pod's annotation that reached past
    /// its bound and were clipped (empty: none).
    Policy(Option<EgressPolicy>, String, Vec<String>),
    /// Keep what is in force and warn (reason, note).
    Keep(&'static str, String),
}

/// Resolves the pod's effective policy against the templates this node
/// sees: its SandboxTemplate's `spec.egressPolicy` (else the cluster's
/// default, the built-in one), narrowed by the pod's own annotation when it
/// has one — never widened ([`bounded_policy`]).
fn wanted(pod: &Pod, ns: &str, templates: &Store<SandboxTemplate>) -> Wanted {
    let annotations = pod.annotations();
    let own = annotations.get(EGRESS_POLICY_ANNOTATION);
    let template_name = annotations.get(TEMPLATE_ANNOTATION);
    let template = match template_name {
        Some(name) => match templates.get(&ObjectRef::new(name).within(ns)) {
            Some(t) => Some(t),
            None => {
                return Wanted::Keep(
                    TEMPLATE_NOT_FOUND,
                    format!(
                        "SandboxTemplate {name} is gone, so the egress policy that bounds the \
                         pod's is unknown; the policy in force is kept"
                    ),
                )
            }
        },
        None => None,
    };
    let template_policy = template
        .as_ref()
        .and_then(|t| t.spec.egress_policy.as_ref());
    let bound_source = match (template_policy, template_name) {
        (Some(_), Some(name)) => format!("SandboxTemplate {name}"),
        _ => "the built-in default".to_string(),
    };
    let Some(text) = own else {
        return match effective_policy(template_policy, None) {
            Err(e) => Wanted::Keep(INVALID, format!("the egress policy is not changed: {e}")),
            Ok(policy) => Wanted::Policy(
                template_policy.is_some().then_some(policy),
                bound_source,
                Vec::new(),
            ),
        };
    };
    let path = format!("metadata.annotations[{EGRESS_POLICY_ANNOTATION}]");
    let bound = template_policy.cloned().unwrap_or_default();
    let bound_path = match template_name.filter(|_| template_policy.is_some()) {
        Some(name) => format!("SandboxTemplate {name}'s spec.egressPolicy"),
        None => "the cluster's default egress policy".to_string(),
    };
    match parse_policy(text, &path).and_then(|p| bounded_policy(&p, &bound, &bound_path)) {
        Err(e) => Wanted::Keep(INVALID, format!("the egress policy is not changed: {e}")),
        Ok(b) => Wanted::Policy(
            Some(b.policy),
            format!("annotation {EGRESS_POLICY_ANNOTATION} within {bound_source}"),
            b.clipped,
        ),
    }
}

/// Is this a Twig pod this controller's node runs, and still running?
fn is_ours(pod: &Pod, ctx: &Context) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let finished = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    spec.node_name.as_deref() == Some(ctx.node_name.as_str())
        && spec.runtime_class_name.as_deref() == Some(RUNTIME_CLASS)
        && pod.metadata.deletion_timestamp.is_none()
        && !finished
}

/// Reconciles one pod's network path.
pub async fn reconcile(
    pod: Arc<Pod>,
    ctx: Arc<Context>,
    templates: Store<SandboxTemplate>,
) -> Result<Action, Error> {
    let ns = pod
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = pod.name_any();
    if !is_ours(&pod, &ctx) {
        ctx.metrics.remove_pod_network(&ns, &name);
        return Ok(Action::await_change());
    }
    let sandbox = match ctx.locator.locate(&pod).await {
        Ok(sandbox) => sandbox,
        // Not started yet (or gone): its status changes when it starts.
        Err(LocateError::NotFound(_)) => {
            ctx.metrics.remove_pod_network(&ns, &name);
            return Ok(Action::requeue(ctx.network_refresh));
        }
        Err(e) => return Err(e.into()),
    };
    let _guard = ctx.lock_pod(&ns, &name).await;
    let stats = match ctx.shim.stats(&sandbox).await {
        Ok(stats) => stats,
        Err(ShimError::NotFound(_)) => {
            ctx.metrics.remove_pod_network(&ns, &name);
            return Ok(Action::requeue(ctx.network_refresh));
        }
        Err(e) => return Err(e.into()),
    };
    let Some(network) = stats.network else {
        // No network path (e.g. host networking): nothing to enforce or count.
        ctx.metrics.remove_pod_network(&ns, &name);
        return Ok(Action::requeue(ctx.network_refresh));
    };
    ctx.metrics
        .set_pod_network(&ns, &name, network.counters.clone());
    // The template cache is filled before any pod names a template that
    // is "gone"; it only fails once the controller is stopping.
    if templates.wait_until_ready().await.is_err() {
        return Ok(Action::await_change());
    }
    let (policy, source, unclipped) = match wanted(&pod, &ns, &templates) {
        Wanted::Keep(reason, note) => {
            tracing::warn!(pod = %format!("{ns}/{name}"), reason, %note, "egress policy kept");
            ctx.warn_pod_once(&pod, reason, ACTION, note).await;
            return Ok(Action::requeue(ctx.network_refresh));
        }
        Wanted::Policy(policy, source, clipped) => {
            if !clipped.is_empty() {
                let note = format!(
                    "the pod's {EGRESS_POLICY_ANNOTATION} may only narrow its bound; it runs with \
                     the part both allow: {}",
                    clipped.join("; ")
                );
                ctx.warn_pod_once(&pod, CLIPPED, ACTION, note).await;
            }
            (policy, source, clipped.is_empty())
        }
    };
    let target = policy.clone().unwrap_or_default();
    if network.egress_policy.as_ref() == Some(&target) {
        if unclipped {
            ctx.clear_pod_warning(&ns, &name);
        }
        return Ok(Action::requeue(ctx.network_refresh));
    }
    if let Err(e) = ctx.shim.set_egress_policy(&sandbox, policy.as_ref()).await {
        let note = format!("setting the egress policy of {source} failed: {e}");
        ctx.warn_pod_once(&pod, FAILED, ACTION, note).await;
        return Err(e.into());
    }
    if unclipped {
        ctx.clear_pod_warning(&ns, &name);
    }
    tracing::info!(pod = %format!("{ns}/{name}"), %source, "egress policy updated");
    let note = format!("Egress policy in force is now that of {source}");
    ctx.event(pod.as_ref(), EventType::Normal, UPDATED, ACTION, note)
        .await;
    Ok(Action::requeue(ctx.network_refresh))
}

/// Emits once per change of a template's policy, or of its presence: the
/// triggers that make every pod of the node look again. Called on the
/// reflected stream, so the store already holds what each event says.
fn template_changes(
    events: impl Stream<Item = Result<watcher::Event<SandboxTemplate>, watcher::Error>>,
) -> impl Stream<Item = ()> {
    let mut seen: HashMap<ObjectRef<SandboxTemplate>, Option<EgressPolicy>> = HashMap::new();
    events.filter_map(move |event| {
        let changed = match event {
            Ok(watcher::Event::Apply(t) | watcher::Event::InitApply(t)) => {
                let policy = t.spec.egress_policy.clone();
                seen.insert(ObjectRef::from_obj(&t), policy.clone()) != Some(policy)
            }
            Ok(watcher::Event::Delete(t)) => seen.remove(&ObjectRef::from_obj(&t)).is_some(),
            // A relist may have missed deletions.
            Ok(watcher::Event::InitDone) => true,
            Ok(watcher::Event::Init) => false,
            Err(e) => {
                tracing::warn!(error = %e, "watching SandboxTemplates");
                false
            }
        };
        std::future::ready(changed.then_some(()))
    })
}

/// Runs the pod network controller of this node until the future is dropped.
pub(crate) async fn run(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let (templates, writer) = reflector::store();
    let template_events = watcher(
        Api::<SandboxTemplate>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(writer);
    let on_node = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node_name));
    let controller = Controller::new(Api::<Pod>::all(client), on_node)
        .reconcile_all_on(template_changes(template_events));
    let pods = controller.store();
    let results = controller.run(
        move |pod, ctx| {
            let templates = templates.clone();
            async move {
                let key = backoff_key(pod.as_ref());
                let result = reconcile(pod, ctx.clone(), templates).await;
                if result.is_ok() {
                    ctx.backoff.succeeded(&key);
                }
                result
            }
        },
        error_policy,
        ctx.clone(),
    );
    tokio::join!(drain(results), prune(&ctx, &pods));
}

/// Every `network_refresh`, drops the metric series and remembered
/// warnings of pods that are gone (a deleted pod is never reconciled again).
async fn prune(ctx: &Context, pods: &Store<Pod>) {
    let mut tick = tokio::time::interval(ctx.network_refresh);
    loop {
        tick.tick().await;
        let present = |ns: &str, name: &str| {
            pods.get(&ObjectRef::new(name).within(ns))
                .is_some_and(|p| is_ours(&p, ctx))
        };
        ctx.metrics.retain_pod_network(present);
        ctx.retain_pod_warnings(present);
    }
}
