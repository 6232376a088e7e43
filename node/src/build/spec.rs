//! What one `EnsureTemplate` asks to build: the template's node-store id,
//! its inputs and their digest, the logins to pull with, and where the
//! build runs (a build Pod the controller made, or one the node runs).

use sha2::{Digest, Sha256};
use twig_cri::api;
use twig_proto::twig::EnsureTemplateRequest;

use crate::error::{Error, Result};
/// The node-store id of template `key` (`namespace/name`).
pub fn template_id(key: &str) -> Result<String> {
    let (namespace, name) = key.split_once('/').ok_or_else(|| {
        Error::InvalidArgument(format!("template name {key:?} is not namespace/name"))
    })?;
    twig_store::layout::template_id(namespace, name).map_err(|e| match e {
        twig_store::Error::InvalidArgument(m) => Error::InvalidArgument(m),
        other => other.into(),
    })
}

/// What one `EnsureTemplate` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// `namespace/name` of the SandboxTemplate.
    pub key: String,
    /// Its node-store id.
    pub id: String,
    /// The image.
    pub image: String,
    /// The container's command (empty: the image's).
    pub command: Vec<String>,
    /// Run inside the container before the snapshot (empty: nothing).
    pub warmup: Vec<String>,
    /// Digest of the three above ([`SPEC_LABEL`]).
    pub digest: String,
    /// The template's egress policy (JSON as asked; checked), for its pods
    /// without their own: not an input of the build.
    pub egress_policy: Option<String>,
    /// The registry logins to pull the image with, in order (the template
    /// namespace's pull secrets that match the image's registry): not an
    /// input of the build, and never shown by `Debug`.
    pub credentials: Credentials,
    /// Where the build runs (not an input: it does not change the digest).
    pub runs_in: RunsIn,
}

/// Where a template's build runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunsIn {
    /// A pod the node runs itself through CRI (a node no kubelet manages).
    NodePod,
    /// A Pod the controller made, kubelet runs: its UID, `None` while the
    /// controller has none.
    BuildPod(Option<String>),
}

/// One registry login (`EnsureTemplateRequest.pull_credentials`); its
/// `Debug` shows the registry and the user, never a secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    /// The registry host it is for.
    pub server: String,
    /// The user name (with `password`).
    pub username: String,
    /// The password.
    pub password: String,
    /// A token for the registry's identity provider.
    pub identity_token: String,
    /// A bearer token for the registry.
    pub registry_token: String,
    /// base64 of `username:password` (a docker config's `auth`).
    pub auth: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("server", &self.server)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl Credential {
    /// CRI's `AuthConfig` of this login, as kubelet fills it.
    pub(super) fn auth_config(&self) -> api::AuthConfig {
        api::AuthConfig {
            username: self.username.clone(),
            password: self.password.clone(),
            server_address: self.server.clone(),
            identity_token: self.identity_token.clone(),
            registry_token: self.registry_token.clone(),
            auth: self.auth.clone(),
        }
    }
}

/// The logins a build pulls with, in the order they are tried.
pub type Credentials = Vec<Credential>;

impl Spec {
    /// The build `req` asks for; `req.name` is `namespace/name`.
    pub fn from_request(req: &EnsureTemplateRequest) -> Result<Spec> {
        let id = template_id(&req.name)?;
        let egress_policy = match req.egress_policy.as_str() {
            "" => None,
            json => {
                twig_net::parse_policy(json, "egress_policy")
                    .map_err(|e| Error::InvalidArgument(format!("template {}: {e}", req.name)))?;
                Some(json.to_string())
            }
        };
        if req.image.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "template {}: empty image",
                req.name
            )));
        }
        let mut credentials = Vec::with_capacity(req.pull_credentials.len());
        for (i, c) in req.pull_credentials.iter().enumerate() {
            // Only which field is missing is said: a login is a secret.
            if c.server.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "template {}: pull_credentials[{i}] names no registry",
                    req.name
                )));
            }
            credentials.push(Credential {
                server: c.server.clone(),
                username: c.username.clone(),
                password: c.password.clone(),
                identity_token: c.identity_token.clone(),
                registry_token: c.registry_token.clone(),
                auth: c.auth.clone(),
            });
        }
        let mut h = Sha256::new();
        // The build's own version: v2 snapshots record their owning
        // namespace, and a template built before restores into no pod, so
        // it is built again.
        h.update(b"twig-template-v2\0");
        for part in [&[req.image.clone()][..], &req.command, &req.warmup] {
            for s in part {
                h.update(s.as_bytes());
                h.update(b"\0");
            }
            h.update(b"\x01");
        }
        let digest = h
            .finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Spec {
            key: req.name.clone(),
            id,
            image: req.image.clone(),
            command: req.command.clone(),
            warmup: req.warmup.clone(),
            digest,
            egress_policy,
            credentials,
            runs_in: match req.build_pod.as_ref() {
                None => RunsIn::NodePod,
                Some(p) if p.uid.is_empty() => RunsIn::BuildPod(None),
                Some(p) => RunsIn::BuildPod(Some(p.uid.clone())),
            },
        })
    }

    /// The same build on base template `base_id`: its digest covers the
    /// base's too, so a new guest kernel or agent (a new base template)
    /// builds the app template again — its memory holds the agent it was
    /// built with, and an old agent lacks what a new shim calls.
    pub fn built_on(mut self, base_id: &str) -> Spec {
        let mut h = Sha256::new();
        h.update(self.digest.as_bytes());
        h.update(b"\0");
        h.update(base_id.as_bytes());
        self.digest = h
            .finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        self
    }

    /// The build pod's name (a Kubernetes name: the key's `/` is a `-`).
    pub(super) fn pod_name(&self) -> String {
        format!("twig-template-{}", self.key.replace('/', "-"))
    }
}
