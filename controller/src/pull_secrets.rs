//! A SandboxTemplate's image pull secrets, as a pod without
//! `serviceAccountName` gets them: the `imagePullSecrets` of the template
//! namespace's `default` ServiceAccount (what the ServiceAccount admission
//! plugin copies into such a pod). They go, by name, into the template's
//! build Pod, and kubelet pulls its image with them as with any pod's: the
//! registry decides whether the namespace may have the image. The
//! controller never reads a Secret.

use k8s_openapi::api::core::v1::ServiceAccount;
use kube::{Api, Client};

use crate::context::is_not_found;

/// The ServiceAccount whose `imagePullSecrets` a template's build uses.
pub const SERVICE_ACCOUNT: &str = "default";

/// The names of the pull secrets of namespace `namespace`'s
/// [`SERVICE_ACCOUNT`] (none when it does not exist), in order.
pub async fn names(client: &Client, namespace: &str) -> Result<Vec<String>, kube::Error> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let account = match accounts.get(SERVICE_ACCOUNT).await {
        Ok(a) => a,
        Err(e) if is_not_found(&e) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(account
        .image_pull_secrets
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.name)
        .filter(|n| !n.is_empty())
        .collect())
}
