//! Snapshots to and from an OCI registry (`ExportSnapshot`,
//! `ImportSnapshot`), through twig-oci, with the node's registry
//! credentials. A namespace reaches only its own repositories
//! (`<prefix>/<namespace>/<name>`) and its own snapshots.

use serde::Deserialize;
use std::path::PathBuf;
use twig_oci::{Client, Credentials, Reference};
use twig_proto::twig::{ExportSnapshotResponse, ImportSnapshotResponse};
use twig_store::NodeStore;

use crate::error::{Error, Result};

/// The registry settings of a node.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// A Docker `config.json` with the node's registry credentials (the
    /// chart mounts a `kubernetes.io/dockerconfigjson` Secret); none:
    /// anonymous.
    pub credentials: Option<PathBuf>,
    /// Registries (`host:port`) spoken to over plain HTTP (a registry on
    /// the node's loopback); all others over HTTPS.
    pub plain_http: Vec<String>,
    /// The first path component(s) of every snapshot repository:
    /// `<prefix>/<namespace>/<name>`.
    pub repository_prefix: String,
}

impl Default for RegistryConfig {
    fn default() -> RegistryConfig {
        RegistryConfig {
            credentials: None,
            plain_http: Vec::new(),
            repository_prefix: "twig".into(),
        }
    }
}

/// The node's registry client and rules.
pub struct Registry {
    client: Client,
    prefix: String,
}

impl Registry {
    /// The client of `config` (its credentials read now: a node with
    /// unreadable credentials does not start).
    pub fn new(config: &RegistryConfig) -> Result<Registry> {
        let creds = match &config.credentials {
            Some(p) => Credentials::load(p).map_err(|e| {
                Error::InvalidArgument(format!("registry credentials {}: {e}", p.display()))
            })?,
            None => Credentials::default(),
        };
        let client = Client::new(creds, config.plain_http.clone())
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok(Registry {
            client,
            prefix: config.repository_prefix.trim_matches('/').to_string(),
        })
    }

    /// `reference` parsed, refused unless its repository is
    /// `<prefix>/<namespace>/<name>`.
    fn reference(&self, reference: &str, namespace: &str) -> Result<Reference> {
        twig_store::layout::validate_owner(namespace)?;
        let r = Reference::parse(reference).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let own = format!("{}/{namespace}/", self.prefix);
        let name = r.repository.strip_prefix(&own).unwrap_or_default();
        if name.is_empty() || name.contains('/') {
            return Err(Error::PermissionDenied(format!(
                "{reference}: namespace {namespace:?} exports to and imports from {own}<name> only"
            )));
        }
        Ok(r)
    }

    /// Pushes snapshot `id`, owned by `namespace`, to `reference`.
    pub async fn export(
        &self,
        store: &NodeStore,
        id: &str,
        reference: &str,
        namespace: &str,
    ) -> Result<ExportSnapshotResponse> {
        let to = self.reference(reference, namespace)?;
        store.get(id)?.check_owner(Some(namespace))?;
        let p = twig_oci::push(&self.client, store, id, &to).await?;
        Ok(ExportSnapshotResponse {
            digest: p.digest,
            bytes_uploaded: p.bytes_uploaded,
            snapshots_pushed: p.snapshots_pushed as u32,
            snapshots_present: p.snapshots_present as u32,
            ..Default::default()
        })
    }

    /// Pulls `reference`, which must belong to `namespace`, as snapshot `id`
    /// (an app template built on another node).
    pub async fn import_as(
        &self,
        store: &NodeStore,
        reference: &str,
        namespace: &str,
        id: &str,
    ) -> Result<twig_oci::Pulled> {
        let from = self.reference(reference, namespace)?;
        Ok(twig_oci::pull_as(&self.client, store, &from, Some(namespace), id).await?)
    }

    /// Pulls `reference`, which must belong to `namespace`.
    pub async fn import(
        &self,
        store: &NodeStore,
        reference: &str,
        namespace: &str,
    ) -> Result<ImportSnapshotResponse> {
        let from = self.reference(reference, namespace)?;
        let p = twig_oci::pull(&self.client, store, &from, Some(namespace)).await?;
        Ok(ImportSnapshotResponse {
            snapshot_id: p.id,
            digest: p.digest,
            bytes_downloaded: p.bytes_downloaded,
            snapshots_pulled: p.snapshots_pulled as u32,
            ..Default::default()
        })
    }
}
