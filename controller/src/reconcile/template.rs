//! SandboxTemplate: every node builds the template through its node service
//! and lists itself in the status; deleting the object removes it from every node.

use std::sync::Arc;
use std::time::Instant;

use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use super::write_status;
use crate::context::{add_finalizer, remove_finalizer, Context, Error};
use crate::crd::{SandboxTemplate, SandboxTemplateStatus, TemplateNodeStatus};

/// Finalizer that keeps a SandboxTemplate until every node has removed it.
pub const FINALIZER: &str = "twig.dev/template-data";

/// Checks what the CRD schema checks, for objects written before it was installed.
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
    if !(64..=262_144).contains(&spec.memory_mib) {
        return Err(format!(
            "spec.memoryMiB must be between 64 and 262144, not {}",
            spec.memory_mib
        ));
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
    let status = template.status.clone().unwrap_or_default();
    let mine = status
        .nodes
        .iter()
        .find(|n| n.node_name == ctx.node_name)
        .cloned();
    if template.metadata.deletion_timestamp.is_some() {
        let mut template = (*template).clone();
        if mine.is_some() {
            ctx.node.delete_template(&key(&template)).await?;
            let mut status = status;
            status.nodes.retain(|n| n.node_name != ctx.node_name);
            template = write_status(&api, &template, status).await?;
            let note = format!("Removed template from node {}", ctx.node_name);
            ctx.event(&template, EventType::Normal, "Removed", "Delete", note)
                .await;
        }
        if template.status.as_ref().is_none_or(|s| s.nodes.is_empty()) {
            remove_finalizer(&api, &template, FINALIZER).await?;
        }
        return Ok(Action::await_change());
    }
    if let Err(message) = validate(&template) {
        let entry = TemplateNodeStatus {
            node_name: ctx.node_name.clone(),
            ready: false,
            message: Some(message.clone()),
        };
        if mine.as_ref() != Some(&entry) {
            write_status(&api, &template, upsert(status, entry)).await?;
            ctx.event(
                template.as_ref(),
                EventType::Warning,
                "Invalid",
                "Template",
                message,
            )
            .await;
        }
        return Ok(Action::await_change());
    }
    let template = add_finalizer(&api, &template, FINALIZER).await?;
    let started = Instant::now();
    let result = ctx
        .node
        .ensure_template(&key(&template), &template.spec)
        .await;
    let entry = match result {
        Ok(state) => TemplateNodeStatus {
            node_name: ctx.node_name.clone(),
            ready: state.ready,
            message: state.message,
        },
        Err(e) => {
            ctx.metrics
                .observe("template", false, started.elapsed().as_secs_f64());
            TemplateNodeStatus {
                node_name: ctx.node_name.clone(),
                ready: false,
                message: Some(format!("building the template failed: {e}")),
            }
        }
    };
    if mine.as_ref() != Some(&entry) {
        let template = write_status(&api, &template, upsert(status, entry.clone())).await?;
        let was_ready = mine.is_some_and(|m| m.ready);
        if entry.ready && !was_ready {
            ctx.metrics
                .observe("template", true, started.elapsed().as_secs_f64());
            let note = format!("Template ready on node {}", ctx.node_name);
            ctx.event(&template, EventType::Normal, "Ready", "Template", note)
                .await;
        } else if !entry.ready {
            let note = entry
                .message
                .clone()
                .unwrap_or_else(|| "template not ready".to_string());
            ctx.event(&template, EventType::Normal, "Building", "Template", note)
                .await;
        }
    }
    Ok(if entry.ready {
        Action::await_change()
    } else {
        Action::requeue(ctx.retry)
    })
}

fn upsert(mut status: SandboxTemplateStatus, entry: TemplateNodeStatus) -> SandboxTemplateStatus {
    match status
        .nodes
        .iter_mut()
        .find(|n| n.node_name == entry.node_name)
    {
        Some(existing) => *existing = entry,
        None => status.nodes.push(entry),
    }
    status.nodes.sort_by(|a, b| a.node_name.cmp(&b.node_name));
    status.ready_nodes =
        i32::try_from(status.nodes.iter().filter(|n| n.ready).count()).unwrap_or(i32::MAX);
    status
}
