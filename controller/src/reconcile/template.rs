//! SandboxTemplate: every node builds the template through its node service
//! and server-side applies its own entry of `status.nodes` (a map keyed by
//! node name), so nodes never overwrite each other's entries. Each node keeps
//! its own finalizer `twig.dev/template.<node>` (kube-runtime's helper) and
//! removes it once the template is gone from its node; the finalizers of
//! nodes whose Node object no longer exists are removed by any other node.
//!
//! A template is built in a **build Pod** this node's controller makes
//! when the node store lacks it (the node answers `needs_build_pod`): bound
//! to this node, RuntimeClass `twig`, the template's image and command in
//! its one container `template`, the namespace's pull secrets (those of its
//! `default` ServiceAccount, [`crate::pull_secrets`]) as its
//! `imagePullSecrets`, controlled by the SandboxTemplate, label
//! `twig.dev/template-build`. Kubelet runs and pulls it like any pod — a
//! sandbox kubelet did not make would be stopped by kubelet as an orphan —
//! and the node finds it by UID, warms it up and snapshots it. The Pod is
//! deleted once the template is ready, when the build failed in it (it is
//! spent: the next attempt gets a new Pod), when it stopped or belongs to
//! an older generation of the template, and when the template goes.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use json_patch::jsonptr::PointerBuf;
use json_patch::{PatchOperation, ReplaceOperation, TestOperation};
use k8s_openapi::api::core::v1::{Container, LocalObjectReference, Node, Pod, PodSpec, Toleration};
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{finalizer, Event};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use super::apply_status;
use crate::context::{bounded_name, is_not_found, template_finalizer, Context, Error};
use crate::crd::{
    SandboxTemplate, SandboxTemplateStatus, TemplateNodeStatus, NETWORK_ANNOTATION, NETWORK_NONE,
    RUNTIME_CLASS,
};
use crate::pull_secrets;
use crate::shim::{BuildIn, PULLED_FROM};
use twig_proto::contract::{TEMPLATE_BUILD_CONTAINER, TEMPLATE_BUILD_LABEL};

/// Prefix of every node's SandboxTemplate finalizer (`twig.dev/template.<node>`).
pub const FINALIZER_PREFIX: &str = "twig.dev/template";

/// Smallest guest RAM twig-vmm accepts, in MiB.
pub const MIN_MEMORY_MIB: u32 = 16;
/// Largest guest RAM twig-vmm accepts, in MiB (guest RAM ends below the 3 GiB MMIO gap).
pub const MAX_MEMORY_MIB: u32 = 3072;

/// Checks what the CRD schema checks, for objects written before it was
/// installed, and what it cannot say: the egress policy's CIDR syntax, port
/// ranges upside down or too wide, ports on ICMP (`EgressPolicy::validate`,
/// every problem with its field under `spec.egressPolicy`).
pub fn validate(template: &SandboxTemplate) -> Result<(), String> {
    let spec = &template.spec;
    if spec.image.is_empty() {
        return Err("spec.image must not be empty".to_string());
    }
    if !(1..=64).contains(&spec.vcpus) {
        return Err(format!(
            "spec.vcpus must be between 1 and 64, not {}",
            spec.vcpus
        ));
    }
    let mib = spec.memory_mib;
    if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&mib) || mib % 2 != 0 {
        return Err(format!(
            "spec.memoryMiB {mib} is not accepted by twig-vmm: guest RAM is a multiple of 2 MiB from {MIN_MEMORY_MIB} to {MAX_MEMORY_MIB} MiB"
        ));
    }
    if let Some(policy) = &spec.egress_policy {
        policy
            .validate()
            .map_err(|e| e.at("spec.egressPolicy").to_string())?;
    }
    Ok(())
}

fn key(template: &SandboxTemplate) -> String {
    format!(
        "{}/{}",
        template.namespace().unwrap_or_default(),
        template.name_any()
    )
}

/// Reconciles one SandboxTemplate on this node.
pub async fn reconcile(template: Arc<SandboxTemplate>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = template
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<SandboxTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    let deleting = template.metadata.deletion_timestamp.is_some();
    let mine = ctx.template_finalizer();
    let action = if deleting && !template.finalizers().contains(&mine) {
        Action::await_change()
    } else {
        let (inner, ctx) = (api.clone(), ctx.clone());
        finalizer(&api, &mine, template.clone(), |event| async move {
            match event {
                Event::Apply(template) => build(&inner, &template, &ctx).await,
                Event::Cleanup(template) => remove(&inner, &template, &ctx).await,
            }
        })
        .await?
    };
    if deleting {
        return release_gone_nodes(&api, &template, &ctx).await;
    }
    Ok(action)
}

/// Builds the template on this node and applies this node's status entry.
async fn build(
    api: &Api<SandboxTemplate>,
    template: &SandboxTemplate,
    ctx: &Context,
) -> Result<Action, Error> {
    let status = template.status.clone().unwrap_or_default();
    let mine = status
        .nodes
        .iter()
        .find(|n| n.node_name == ctx.node_name)
        .cloned();
    if let Err(message) = validate(template) {
        let entry = TemplateNodeStatus {
            node_name: ctx.node_name.clone(),
            ready: false,
            message: Some(message.clone()),
            artifact: None,
        };
        if write_entry(api, template, &status, Some(&entry), ctx).await? {
            ctx.event(template, EventType::Warning, "Invalid", "Template", message)
                .await;
        }
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(
        ctx.client.clone(),
        &template.namespace().unwrap_or_default(),
    );
    let current = current_build_pod(&pods, template, ctx).await?;
    let waiting = current.as_ref().and_then(waiting_reason);
    let mut build_pod = current.and_then(|p| p.metadata.uid);
    // Another node's build in the registry: pulled instead of built (the
    // node builds when its inputs differ).
    let theirs = status
        .nodes
        .iter()
        .filter(|n| n.node_name != ctx.node_name && n.ready)
        .find_map(|n| n.artifact.clone());
    let ensure = |pod: Option<String>| {
        let theirs = theirs.clone();
        async move {
            ctx.node
                .ensure_template(
                    &key(template),
                    &template.spec,
                    BuildIn::BuildPod(pod.as_deref()),
                    theirs.as_deref(),
                )
                .await
        }
    };
    let mut result = ensure(build_pod.clone()).await;
    if build_pod.is_none() && result.as_ref().is_ok_and(|s| s.needs_build_pod) {
        build_pod = Some(create_build_pod(&pods, template, ctx).await?);
        result = ensure(build_pod.clone()).await;
    }
    // Done with the Pod: built, or spent by a failed build.
    if build_pod.is_some() && result.as_ref().is_ok_and(|s| s.ready || s.failed) {
        delete_build_pod(&pods, template, ctx).await?;
    }
    let entry = match result {
        Ok(state) => TemplateNodeStatus {
            node_name: ctx.node_name.clone(),
            ready: state.ready,
            artifact: match state.ready {
                true => artifact_of(template, mine.as_ref(), state.message.as_deref(), ctx).await,
                false => None,
            },
            // Why kubelet has not started the build Pod, if it says.
            message: match (state.message, waiting.filter(|_| !state.ready)) {
                (Some(m), Some(w)) => Some(format!("{m}; {w}")),
                (m, w) => m.or(w),
            },
        },
        Err(e) => {
            ctx.metrics
                .observe("template", false, started.elapsed().as_secs_f64());
            TemplateNodeStatus {
                node_name: ctx.node_name.clone(),
                ready: false,
                message: Some(format!("building the template failed: {e}")),
                artifact: None,
            }
        }
    };
    let changed = mine.as_ref() != Some(&entry);
    write_entry(api, template, &status, Some(&entry), ctx).await?;
    if changed {
        let was_ready = mine.is_some_and(|m| m.ready);
        if entry.ready && !was_ready {
            ctx.metrics
                .observe("template", true, started.elapsed().as_secs_f64());
            let note = format!("Template ready on node {}", ctx.node_name);
            ctx.event(template, EventType::Normal, "Ready", "Template", note)
                .await;
        } else if !entry.ready {
            let note = entry
                .message
                .clone()
                .unwrap_or_else(|| "template not ready".to_string());
            ctx.event(template, EventType::Normal, "Building", "Template", note)
                .await;
        }
    }
    // Ready, and in the registry when there is one (an export that failed
    // is tried again).
    Ok(
        if entry.ready && (entry.artifact.is_some() || ctx.registry.is_none()) {
            Action::await_change()
        } else {
            Action::requeue(ctx.retry)
        },
    )
}

/// Where this node's ready build of `template` is in the registry: the
/// artifact it was pulled from, the one recorded before, or (with a
/// registry) its export now. None: no registry, or the export failed (it is
/// tried again at the next reconcile; the template is ready regardless).
async fn artifact_of(
    template: &SandboxTemplate,
    mine: Option<&TemplateNodeStatus>,
    message: Option<&str>,
    ctx: &Context,
) -> Option<String> {
    if let Some(pulled) = message.and_then(|m| m.strip_prefix(PULLED_FROM)) {
        return Some(pulled.to_string());
    }
    if let Some(a) = mine.filter(|m| m.ready).and_then(|m| m.artifact.clone()) {
        return Some(a);
    }
    let registry = ctx.registry.as_ref()?;
    let ns = template.namespace()?;
    let repository = registry.repository(&ns, &format!("template-{}", template.name_any()));
    let reference = format!(
        "{repository}:g{}",
        template.metadata.generation.unwrap_or_default()
    );
    let id = format!("template.{ns}.{}", template.name_any());
    match ctx.node.export_snapshot(&id, &reference, &ns).await {
        Ok(pushed) => Some(format!("{repository}@{}", pushed.digest)),
        Err(e) => {
            let note = format!("pushing the template to {reference} failed: {e}");
            ctx.event(
                template,
                EventType::Warning,
                "ExportFailed",
                "Template",
                note,
            )
            .await;
            None
        }
    }
}

/// Removes the template from this node and this node's entry from the status.
async fn remove(
    api: &Api<SandboxTemplate>,
    template: &SandboxTemplate,
    ctx: &Context,
) -> Result<Action, Error> {
    let pods: Api<Pod> = Api::namespaced(
        ctx.client.clone(),
        &template.namespace().unwrap_or_default(),
    );
    delete_build_pod(&pods, template, ctx).await?;
    ctx.node.delete_template(&key(template)).await?;
    let status = template.status.clone().unwrap_or_default();
    if status.nodes.iter().any(|n| n.node_name == ctx.node_name) {
        write_entry(api, template, &status, None, ctx).await?;
    }
    let note = format!("Removed template from node {}", ctx.node_name);
    ctx.event(template, EventType::Normal, "Removed", "Delete", note)
        .await;
    Ok(Action::await_change())
}

/// Server-side applies this node's entry of `status.nodes` (none: removes
/// it) and the ready count it sees; `Ok(false)` when nothing needed writing.
async fn write_entry(
    api: &Api<SandboxTemplate>,
    template: &SandboxTemplate,
    status: &SandboxTemplateStatus,
    entry: Option<&TemplateNodeStatus>,
    ctx: &Context,
) -> Result<bool, Error> {
    let others = status.nodes.iter().filter(|n| n.node_name != ctx.node_name);
    let ready = others.filter(|n| n.ready).count() + usize::from(entry.is_some_and(|e| e.ready));
    let ready_nodes = i32::try_from(ready).unwrap_or(i32::MAX);
    let current = status.nodes.iter().find(|n| n.node_name == ctx.node_name);
    if current == entry && status.ready_nodes == ready_nodes {
        return Ok(false);
    }
    let body = json!({
        "apiVersion": SandboxTemplate::api_version(&()),
        "kind": SandboxTemplate::kind(&()),
        "metadata": {"name": template.name_any()},
        "status": {"nodes": entry.into_iter().collect::<Vec<_>>(), "readyNodes": ready_nodes},
    });
    match apply_status(api, template, body, ctx).await {
        Ok(_) => Ok(true),
        // The last finalizer went while we worked: the object is gone.
        Err(Error::Kube(e)) if is_not_found(&e) && entry.is_none() => Ok(true),
        Err(e) => Err(e),
    }
}

/// On a deleting template, removes the finalizers of nodes that are gone
/// (no Node object with their name, so no node store either), and of any
/// `twig.dev/template…` finalizer no existing node owns. While other live
/// nodes still hold theirs, looks again every `orphan_check`.
async fn release_gone_nodes(
    api: &Api<SandboxTemplate>,
    template: &SandboxTemplate,
    ctx: &Context,
) -> Result<Action, Error> {
    let mine = ctx.template_finalizer();
    let ours: Vec<&String> = template
        .finalizers()
        .iter()
        .filter(|f| f.starts_with(FINALIZER_PREFIX) && **f != mine)
        .collect();
    if ours.is_empty() {
        return Ok(Action::await_change());
    }
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let live: BTreeSet<String> = nodes
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|n| template_finalizer(&n.name_any()))
        .collect();
    let gone: Vec<String> = ours
        .iter()
        .filter(|f| !live.contains(**f))
        .map(|f| (*f).clone())
        .collect();
    if gone.is_empty() {
        return Ok(Action::requeue(ctx.orphan_check));
    }
    // Remove them all at once, only if the list is still the one we read
    // (without ours, which the helper has removed).
    let current: Vec<&String> = template
        .finalizers()
        .iter()
        .filter(|f| **f != mine)
        .collect();
    let kept: Vec<&String> = current
        .iter()
        .copied()
        .filter(|f| !gone.contains(f))
        .collect();
    let path = || PointerBuf::from_tokens(["metadata", "finalizers"]);
    let patch = json_patch::Patch(vec![
        PatchOperation::Test(TestOperation {
            path: path(),
            value: json!(current),
        }),
        PatchOperation::Replace(ReplaceOperation {
            path: path(),
            value: json!(kept),
        }),
    ]);
    match api
        .patch(
            &template.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
    {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => return Ok(Action::await_change()),
        Err(e) => return Err(e.into()),
    }
    let note = format!(
        "Released the finalizers of nodes that are gone: {}",
        gone.join(", ")
    );
    ctx.event(template, EventType::Warning, "NodeGone", "Delete", note)
        .await;
    tracing::info!(template = %key(template), ?gone, "released the finalizers of gone nodes");
    Ok(if kept.is_empty() {
        Action::await_change()
    } else {
        Action::requeue(ctx.orphan_check)
    })
}

/// Longest Pod name (a DNS subdomain, kept to a label so that its hostname
/// is the whole name).
const MAX_POD_NAME: usize = 63;

/// Annotation of a build Pod: the template's `metadata.generation` it was
/// made for (a Pod of an older spec is replaced).
const GENERATION_ANNOTATION: &str = "twig.dev/template-generation";

/// The name of the build Pod of `template` on this node.
pub fn build_pod_name(template: &SandboxTemplate, node: &str) -> String {
    bounded_name(
        &format!("{}-build-", template.name_any()),
        node,
        MAX_POD_NAME,
    )
}

/// This node's build Pod of `template`, if one is usable: a Pod that
/// stopped (its container exited: the template's command must keep
/// running), is being deleted, or was made for an older generation of the
/// template is deleted instead (`None`; the node then asks for a new one).
async fn current_build_pod(
    pods: &Api<Pod>,
    template: &SandboxTemplate,
    ctx: &Context,
) -> Result<Option<Pod>, Error> {
    let name = build_pod_name(template, &ctx.node_name);
    let Some(pod) = pods.get_opt(&name).await? else {
        return Ok(None);
    };
    let generation = template.metadata.generation.unwrap_or_default().to_string();
    let stale = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GENERATION_ANNOTATION))
        != Some(&generation);
    let stopped = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    if stale || stopped || pod.metadata.deletion_timestamp.is_some() {
        delete_build_pod(pods, template, ctx).await?;
        return Ok(None);
    }
    Ok(Some(pod))
}

/// Why kubelet has not started the build Pod's container, as its status
/// says (`ErrImagePull: …`, `ImagePullBackOff: …`).
pub fn waiting_reason(pod: &Pod) -> Option<String> {
    let waiting = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == TEMPLATE_BUILD_CONTAINER)?
        .state
        .as_ref()?
        .waiting
        .as_ref()?;
    let reason = waiting.reason.as_deref().unwrap_or("Waiting");
    Some(match waiting.message.as_deref() {
        Some(m) if !m.is_empty() => format!("build Pod: {reason}: {m}"),
        _ => format!("build Pod: {reason}"),
    })
}

/// Makes this node's build Pod of `template`; its UID.
async fn create_build_pod(
    pods: &Api<Pod>,
    template: &SandboxTemplate,
    ctx: &Context,
) -> Result<String, Error> {
    let namespace = template.namespace().unwrap_or_default();
    // The namespace's pull secrets, by name, for kubelet to pull with (as
    // the ServiceAccount admission plugin gives a pod its account's).
    let pull_secrets = pull_secrets::names(&ctx.client, &namespace).await?;
    let pod = build_pod(template, &ctx.node_name, &pull_secrets);
    let name = pod.metadata.name.clone().unwrap_or_default();
    let made = match pods.create(&PostParams::default(), &pod).await {
        Ok(p) => p,
        // Made by an earlier reconcile whose answer was lost.
        Err(kube::Error::Api(e)) if e.code == 409 => pods.get(&name).await?,
        Err(e) => return Err(e.into()),
    };
    tracing::info!(template = %key(template), pod = name, "made the template's build Pod");
    made.metadata
        .uid
        .ok_or(Error::MissingField("the build Pod's metadata.uid"))
}

/// Deletes this node's build Pod of `template`, if any.
async fn delete_build_pod(
    pods: &Api<Pod>,
    template: &SandboxTemplate,
    ctx: &Context,
) -> Result<(), Error> {
    let name = build_pod_name(template, &ctx.node_name);
    match pods.delete(&name, &DeleteParams::default()).await {
        Ok(_) => {
            tracing::info!(template = %key(template), pod = name, "deleted the template's build Pod");
            Ok(())
        }
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The build Pod of `template` on `node`: the template's image and command
/// in container `template`, on the node's network with a VM without
/// network (a build is offline; pods restored from the template join their
/// own), no ServiceAccount token or service environment (they would be
/// kept in the template's memory), pulled with `pull_secrets`, tolerating
/// every taint (it is bound to its node already), controlled by the
/// template.
pub fn build_pod(template: &SandboxTemplate, node: &str, pull_secrets: &[String]) -> Pod {
    let owner = template.controller_owner_ref(&());
    let spec = &template.spec;
    Pod {
        metadata: ObjectMeta {
            name: Some(build_pod_name(template, node)),
            namespace: template.namespace(),
            labels: Some([(TEMPLATE_BUILD_LABEL.to_string(), template.name_any())].into()),
            annotations: Some(
                [
                    (NETWORK_ANNOTATION.to_string(), NETWORK_NONE.to_string()),
                    (
                        GENERATION_ANNOTATION.to_string(),
                        template.metadata.generation.unwrap_or_default().to_string(),
                    ),
                ]
                .into(),
            ),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            runtime_class_name: Some(RUNTIME_CLASS.to_string()),
            host_network: Some(true),
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(0),
            image_pull_secrets: (!pull_secrets.is_empty()).then(|| {
                pull_secrets
                    .iter()
                    .map(|n| LocalObjectReference { name: n.clone() })
                    .collect()
            }),
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: TEMPLATE_BUILD_CONTAINER.to_string(),
                image: Some(spec.image.clone()),
                command: spec.command.clone(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}
