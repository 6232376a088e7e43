//! Snapshots to and from an OCI registry (`ExportSnapshot`,
//! `ImportSnapshot`), through twig-oci, with the node's registry
//! credentials. A node speaks only to the registries its configuration
//! names, and a namespace reaches only its own repositories
//! (`<prefix>/<namespace>/<name>`) and its own snapshots.

use serde::Deserialize;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use twig_oci::{Client, Credentials, Reference};
use twig_proto::twig::{ExportSnapshotResponse, ImportSnapshotResponse};
use twig_store::NodeStore;

use crate::error::{Error, Result};

/// The registry settings of a node.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// The registries (`host[:port]`) this node exports to and imports
    /// from, with those of `plain_http`; a reference naming any other is
    /// refused (an artifact reference reaches the node from pod
    /// annotations and objects, so it must not make the node fetch from,
    /// or send its credentials to, anywhere). None at all: no registry.
    pub hosts: Vec<String>,
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
    /// A pod restored from an artifact this node lacks starts once the
    /// snapshot's state and disks are here, its memory served as it
    /// arrives (userfaultfd: [`crate::lazy`]); off, or without
    /// `/dev/userfaultfd`: once the whole snapshot is pulled.
    pub lazy_restore: bool,
    /// The most each lazy restore's background download takes of the
    /// registry link, KiB a second (0: as fast as it comes; a per-download
    /// cap, not a node-wide budget). The pages a
    /// restored guest faults in are fetched apart from it and never
    /// paced, so a low figure delays the snapshot's publication and the
    /// pod's rollbacks (refused until its memory is complete).
    pub lazy_fill_kib_per_s: u64,
}

impl Default for RegistryConfig {
    fn default() -> RegistryConfig {
        RegistryConfig {
            hosts: Vec::new(),
            credentials: None,
            plain_http: Vec::new(),
            repository_prefix: "twig".into(),
            lazy_restore: true,
            lazy_fill_kib_per_s: 0,
        }
    }
}

/// The node's registry client and rules.
pub struct Registry {
    client: Client,
    prefix: String,
    hosts: Vec<String>,
    lazy_dir: Option<PathBuf>,
    fill_pace: Option<NonZeroU64>,
}

/// The device a lazy restore makes its VMM's userfaultfd with.
const USERFAULTFD: &str = "/dev/userfaultfd";

impl Registry {
    /// The client of `config` (its credentials read now: a node with
    /// unreadable credentials does not start); lazy restores' page servers
    /// listen under `run_dir`.
    pub fn new(config: &RegistryConfig, run_dir: &Path) -> Result<Registry> {
        let creds = match &config.credentials {
            Some(p) => Credentials::load(p).map_err(|e| {
                Error::InvalidArgument(format!("registry credentials {}: {e}", p.display()))
            })?,
            None => Credentials::default(),
        };
        let client = Client::new(creds, config.plain_http.clone())
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut hosts: Vec<String> = config
            .hosts
            .iter()
            .chain(&config.plain_http)
            .map(|h| h.to_ascii_lowercase())
            .collect();
        hosts.sort();
        hosts.dedup();
        Ok(Registry {
            client,
            prefix: config.repository_prefix.trim_matches('/').to_string(),
            hosts,
            lazy_dir: (config.lazy_restore && Path::new(USERFAULTFD).exists())
                .then(|| run_dir.to_path_buf()),
            fill_pace: NonZeroU64::new(config.lazy_fill_kib_per_s.saturating_mul(1024)),
        })
    }

    /// `reference` parsed, refused unless its registry is one of the
    /// node's and its repository is `<prefix>/<namespace>/<name>`.
    fn reference(&self, reference: &str, namespace: &str) -> Result<Reference> {
        twig_store::layout::validate_owner(namespace)?;
        let r = Reference::parse(reference).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if self.hosts.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "{reference}: this node has no registry configured (node.json registry.hosts)"
            )));
        }
        if !self.hosts.contains(&r.registry.to_ascii_lowercase()) {
            return Err(Error::PermissionDenied(format!(
                "{reference}: this node speaks to the registries {} only",
                self.hosts.join(", ")
            )));
        }
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

    /// Where lazy restores' page servers listen, if this node restores
    /// lazily.
    pub fn lazy_dir(&self) -> Option<&Path> {
        self.lazy_dir.as_deref()
    }

    /// The pace of lazy restores' background downloads, bytes a second
    /// (none: unpaced).
    pub fn fill_pace(&self) -> Option<NonZeroU64> {
        self.fill_pace
    }

    /// Starts pulling `reference`, which must belong to `namespace`, for a
    /// lazy restore: its state and disks staged and described
    /// ([`twig_store::NodeStore::staged`]), its memory to come.
    pub async fn import_lazy(
        &self,
        store: &NodeStore,
        reference: &str,
        namespace: &str,
    ) -> Result<twig_oci::lazy::LazyPull> {
        let from = self.reference(reference, namespace)?;
        Ok(twig_oci::lazy::pull_lazy(&self.client, store, &from, Some(namespace)).await?)
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
