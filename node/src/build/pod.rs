//! Builds in a build Pod: a Pod the controller made on this node for the
//! template (label `twig.dev/template-build`, its one container
//! `template`), which kubelet runs — and pulls, with the Pod's image pull
//! secrets — like any pod of the twig runtime. The node finds its sandbox
//! by the Pod's UID (kubelet's `metadata.uid` of the CRI sandbox), waits
//! for the container to run, then warms it up and has the shim snapshot
//! it as a build in a node-run pod does. The Pod is the controller's: the
//! node never stops or removes it.

use std::time::Duration;

use twig_cri::{api, CriClient};
use twig_proto::contract::TEMPLATE_BUILD_CONTAINER;

use super::{cri_error, warm_up_and_snapshot, Spec};
use crate::config::TemplateBuildConfig;
use crate::error::{Error, Result};

/// How often the sandbox and container of the build Pod are looked for
/// while kubelet starts them (the build's timeout bounds the wait).
const POLL: Duration = Duration::from_millis(500);

/// Builds `spec` in the build Pod of UID `uid`.
pub(super) async fn build(config: &TemplateBuildConfig, spec: &Spec, uid: &str) -> Result<()> {
    let cri = super::connect(config).await?;
    let (sandbox, container) = started(&cri, config, uid).await?;
    tracing::info!(
        template = spec.key,
        pod_uid = uid,
        sandbox,
        "the build Pod runs: warming it up"
    );
    warm_up_and_snapshot(config, &cri, spec, &sandbox, &container).await
}

/// The sandbox and running `template` container of the Pod `uid`, once
/// kubelet started them (polled until the build's timeout ends the build).
async fn started(
    cri: &CriClient,
    config: &TemplateBuildConfig,
    uid: &str,
) -> Result<(String, String)> {
    loop {
        if let Some(found) = look(cri, config, uid).await? {
            return Ok(found);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// One look for the Pod's ready sandbox and running container.
async fn look(
    cri: &CriClient,
    config: &TemplateBuildConfig,
    uid: &str,
) -> Result<Option<(String, String)>> {
    let sandboxes = cri
        .list_pod_sandboxes()
        .await
        .map_err(cri_error("listing pod sandboxes"))?;
    let Some(sandbox) = sandboxes.into_iter().find(|s| {
        s.state == api::PodSandboxState::SandboxReady as i32
            && s.metadata.as_ref().is_some_and(|m| m.uid == uid)
    }) else {
        return Ok(None);
    };
    if sandbox.runtime_handler != config.runtime_handler {
        return Err(Error::FailedPrecondition(format!(
            "the build Pod (UID {uid}) runs under runtime handler {:?}, not {:?} \
             (templates.runtime_handler): its RuntimeClass is not Twig's",
            sandbox.runtime_handler, config.runtime_handler
        )));
    }
    let containers = cri
        .list_containers(&sandbox.id)
        .await
        .map_err(cri_error("listing the build Pod's containers"))?;
    let Some(c) = containers.into_iter().find(|c| {
        c.metadata
            .as_ref()
            .is_some_and(|m| m.name == TEMPLATE_BUILD_CONTAINER)
    }) else {
        return Ok(None);
    };
    match api::ContainerState::try_from(c.state) {
        Ok(api::ContainerState::ContainerRunning) => Ok(Some((sandbox.id, c.id))),
        Ok(api::ContainerState::ContainerExited) => Err(Error::FailedPrecondition(format!(
            "the build Pod's container {TEMPLATE_BUILD_CONTAINER:?} exited before its warm-up: \
             a template's command must keep running"
        ))),
        _ => Ok(None),
    }
}
