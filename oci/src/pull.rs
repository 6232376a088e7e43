//! Pulling a snapshot and the parents the node lacks: each into a staging
//! directory of the node store, its blobs' digests checked as they
//! stream, published only whole.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use twig_store::{Artefact, Manifest, NodeStore, Staging};

use crate::artifact::{parse_config, Layer, OciManifest, DIGEST_LABEL, MAX_CONFIG};
use crate::client::{hex, next_data, Client};
use crate::error::{Error, Result};
use crate::extents;
use crate::reference::Reference;
use crate::MAX_CHAIN;

/// Largest `state` blob accepted.
const MAX_STATE: u64 = 64 << 20;
/// Largest file an extents blob may decode to (a sparse file: only the
/// records it carries take room).
const MAX_FILE: u64 = 1 << 40;

/// What a pull did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pulled {
    /// The snapshot's id in the node store.
    pub id: String,
    /// Its manifest digest.
    pub digest: String,
    /// Snapshots of the chain pulled now.
    pub snapshots_pulled: usize,
    /// Bytes downloaded, in blobs.
    pub bytes_downloaded: u64,
}

/// How the ids of pulled snapshots start.
pub const PULLED_PREFIX: &str = "oci-";

/// The id a pulled snapshot gets in a node store: derived from its
/// manifest digest, so it never collides with a snapshot the node made.
pub fn pulled_id(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    format!("{PULLED_PREFIX}{}", &hex[..hex.len().min(32)])
}

/// The node store's snapshot of manifest `digest`, if it has one (pushed
/// from here, or pulled before).
pub fn local_by_digest(store: &NodeStore, digest: &str) -> Result<Option<String>> {
    Ok(store
        .list()?
        .into_iter()
        .find(|s| s.labels.get(DIGEST_LABEL).map(String::as_str) == Some(digest))
        .map(|s| s.id))
}

/// Pulls `from` (and the parents the store lacks) into `store`. The
/// snapshot must belong to `owner` (its config says so): a namespace's pod
/// restores only its namespace's snapshots. A failure leaves nothing of
/// the snapshot it was pulling published; parents already published stay
/// (each is whole and checked).
pub async fn pull(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
) -> Result<Pulled> {
    pull_into(client, store, from, owner, None).await
}

/// [`pull`], the snapshot itself published as `id` (its parents as
/// [`pulled_id`]s): e.g. an app template under the id a node's templates
/// have, built once on another node. Pulled again even when the store has
/// it under another id.
pub async fn pull_as(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
    id: &str,
) -> Result<Pulled> {
    twig_store::layout::validate_id(id)?;
    pull_into(client, store, from, owner, Some(id)).await
}

async fn pull_into(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
    leaf_id: Option<&str>,
) -> Result<Pulled> {
    let Resolved {
        digest,
        mut parent,
        mut pending,
    } = resolve(client, store, from, owner, leaf_id).await?;
    let mut out = Pulled {
        digest,
        ..Default::default()
    };
    if pending.is_empty() {
        out.id = local_owned(store, parent, owner)?;
        return Ok(out);
    }
    while let Some(p) = pending.pop() {
        let id = id_for(&p.digest, leaf_id.filter(|_| pending.is_empty()));
        let at = parent.as_deref().map(|id| ParentAt {
            id,
            dir: store.snapshot_dir(id),
            published: true,
        });
        let staging = stage(client, store, from, &id, &p, at.as_ref(), false, &mut out).await?;
        publish(staging, &id)?;
        out.snapshots_pulled += 1;
        parent = Some(id);
    }
    out.id = parent.unwrap_or_default();
    tracing::info!(from = %from, id = %out.id, bytes = out.bytes_downloaded, "snapshot pulled");
    Ok(out)
}

/// One snapshot of a chain to pull: its manifest digest, layers and config.
pub(crate) struct Pending {
    pub digest: String,
    pub layers: Vec<Layer>,
    pub config: Manifest,
}

/// A chain resolved against a store.
pub(crate) struct Resolved {
    /// The leaf's manifest digest.
    pub digest: String,
    /// The snapshot of the store the chain continues (the leaf itself
    /// when nothing is pending).
    pub parent: Option<String>,
    /// What the store lacks, leaf first.
    pub pending: Vec<Pending>,
}

/// Fetches manifests and configs leaf → root until one the store has; the
/// leaf's owner is checked before anything else is downloaded.
pub(crate) async fn resolve(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
    leaf_id: Option<&str>,
) -> Result<Resolved> {
    let (bytes, digest) = client.manifest(from, from.target()).await?;
    let mut pending: Vec<Pending> = Vec::new();
    let mut cur = (bytes, digest.clone());
    let parent = loop {
        if let Some(id) = local_by_digest(store, &cur.1)? {
            let elsewhere = pending.is_empty() && leaf_id.is_some_and(|l| l != id);
            if !elsewhere {
                break Some(id);
            }
        }
        let (m, layers) = OciManifest::parse(&cur.0)?;
        let config = client
            .blob_bytes(from, &m.config.digest, MAX_CONFIG)
            .await?;
        let config = parse_config(&config, &layers, m.subject.is_some())?;
        if pending.is_empty() && config.owner.as_deref() != owner {
            return Err(Error::PermissionDenied(format!(
                "{from} belongs to {}; it may not be pulled for {}",
                config
                    .owner
                    .as_deref()
                    .map_or("no namespace".into(), |o| format!("namespace {o:?}")),
                owner.map_or("a sandbox outside Kubernetes".into(), |o| format!(
                    "namespace {o:?}"
                )),
            )));
        }
        let subject = m.subject.clone();
        pending.push(Pending {
            digest: cur.1,
            layers,
            config,
        });
        if pending.len() > MAX_CHAIN {
            return Err(Error::Corrupt(format!(
                "{from}: a chain longer than {MAX_CHAIN}"
            )));
        }
        match subject {
            None => break None,
            Some(s) => cur = client.manifest(from, &s.digest).await?,
        }
    };
    Ok(Resolved {
        digest,
        parent,
        pending,
    })
}

/// The store's own snapshot `id` (nothing was pending), once `owner` may
/// have it.
pub(crate) fn local_owned(
    store: &NodeStore,
    id: Option<String>,
    owner: Option<&str>,
) -> Result<String> {
    let id = id.unwrap_or_default();
    store.get(&id)?.check_owner(owner).map_err(|e| match e {
        twig_store::Error::PermissionDenied(m) => Error::PermissionDenied(m),
        e => e.into(),
    })?;
    Ok(id)
}

/// The id a pulled snapshot of manifest `digest` is published under.
pub(crate) fn id_for(digest: &str, leaf_id: Option<&str>) -> String {
    match leaf_id {
        Some(id) => id.to_string(),
        None => pulled_id(digest),
    }
}

/// Where a snapshot being pulled finds its parent: published, or staged
/// by the same pull (a lazy pull publishes the chain at its end).
pub(crate) struct ParentAt<'a> {
    pub id: &'a str,
    pub dir: std::path::PathBuf,
    pub published: bool,
}

/// Stages one snapshot as `id`: its labels, its layers (all, or all but
/// its memory if `skip_memory`) downloaded and checked, its state's ids
/// rewritten. A parent staged by the same pull is named at publication
/// (the store names published parents only).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn stage<'s>(
    client: &Client,
    store: &'s NodeStore,
    from: &Reference,
    id: &str,
    p: &Pending,
    parent: Option<&ParentAt<'_>>,
    skip_memory: bool,
    out: &mut Pulled,
) -> Result<Staging<'s>> {
    let config = &p.config;
    let mut staging = store.stage(id)?;
    if parent.is_none_or(|p| p.published) {
        if let Some(p) = parent {
            staging.set_parent(p.id)?;
        }
        staging.set_kind(config.kind);
    }
    if let Some(o) = &config.owner {
        staging.set_owner(o)?;
    }
    for (k, v) in &config.labels {
        staging.set_label(k, v);
    }
    staging.set_label(DIGEST_LABEL, &p.digest);
    for layer in &p.layers {
        if skip_memory && layer.artefact == Artefact::Memory {
            continue;
        }
        let name = layer.artefact.file_name();
        let expected = config.artefacts.get(&name).copied().unwrap_or_default();
        let dest = staging.path(layer.artefact);
        if layer.delta {
            let base = parent
                .map(|p| p.dir.join(&name))
                .filter(|b| b.is_file())
                .ok_or_else(|| {
                    Error::Corrupt(format!("{name} is a delta against a parent that has none"))
                })?;
            staging.put_file(layer.artefact, &base)?;
        }
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&dest)
            .map_err(Error::local("creating a pulled file"))?;
        let got = fetch(client, from, layer, file, expected, None).await?;
        out.bytes_downloaded += got;
    }
    relabel(staging.dir(), id, parent.map(|p| p.id))?;
    Ok(staging)
}

/// Publishes a staged snapshot; `Ok(false)` if another pull published the
/// same (content-addressed) snapshot meanwhile.
pub(crate) fn publish(staging: Staging<'_>, id: &str) -> Result<bool> {
    match staging.publish() {
        Ok(_) => Ok(true),
        // Pulled at the same time by another caller: the same content.
        Err(twig_store::Error::AlreadyExists(_)) if id.starts_with(PULLED_PREFIX) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// What a lazy pull's download reports as it decodes a memory blob: the
/// verified index it checks each record against, and who is told record
/// `i` is written.
pub(crate) struct Watch {
    pub index: std::sync::Arc<extents::Index>,
    pub written: Box<dyn FnMut(usize) + Send>,
    /// At most this many bytes a second.
    pub pace: Option<std::num::NonZeroU64>,
}

/// Streams one layer's blob into `file`, checking its size and digest;
/// returns the bytes downloaded.
pub(crate) async fn fetch(
    client: &Client,
    from: &Reference,
    layer: &Layer,
    file: File,
    expected: u64,
    watch: Option<Watch>,
) -> Result<u64> {
    let what = format!("blob {} ({})", layer.blob.digest, layer.artefact);
    let state = layer.artefact == Artefact::State;
    let limit = if state { MAX_STATE } else { MAX_FILE };
    if expected > limit || (state && expected != layer.blob.size) {
        return Err(Error::Corrupt(format!(
            "{what}: {expected} bytes is not a size it may have"
        )));
    }
    let pace = watch.as_ref().and_then(|w| w.pace);
    let resp = client.blob(from, &layer.blob.digest).await?;
    let started = tokio::time::Instant::now();
    let mut body = resp.into_body();
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let writer = tokio::task::spawn_blocking(move || -> Result<File> {
        let mut r = ChannelReader {
            rx,
            cur: Bytes::new(),
        };
        if state {
            let mut f = &file;
            io::copy(&mut r, &mut f).map_err(Error::local("writing a pulled state"))?;
            f.flush().map_err(Error::local("writing a pulled state"))?;
        } else if let Some(mut w) = watch {
            extents::decode_with(&mut r, &file, expected, Some(&w.index), &mut w.written)?;
        } else {
            extents::decode(&mut r, &file, expected)?;
        }
        file.sync_all()
            .map_err(Error::local("syncing a pulled file"))?;
        Ok(file)
    });
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    let mut broke = None;
    let mut writer_gone = false;
    loop {
        match next_data(&mut body, &what).await {
            Ok(Some(data)) => {
                total += data.len() as u64;
                if total > layer.blob.size {
                    broke = Some(Error::Corrupt(format!(
                        "{what}: longer than its {} bytes",
                        layer.blob.size
                    )));
                    break;
                }
                hasher.update(&data);
                if tx.send(data).await.is_err() {
                    writer_gone = true;
                    break;
                }
                if let Some(pace) = pace {
                    // No faster than `pace`: the next chunk once these
                    // bytes' time has passed.
                    let due = Duration::from_secs_f64(total as f64 / pace.get() as f64);
                    tokio::time::sleep_until(started + due).await;
                }
            }
            Ok(None) => break,
            Err(e) => {
                broke = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let written = writer
        .await
        .map_err(|e| Error::Transfer(format!("{what}: {e}")))?;
    // The writer stopped first (a full disk, a malformed blob): its error
    // says why, not the short digest that follows from it.
    if writer_gone {
        written?;
        return Err(Error::Corrupt(format!("{what}: it decoded before its end")));
    }
    if let Some(e) = broke {
        return Err(e);
    }
    let got = format!("sha256:{}", hex(&hasher.finalize()));
    if total != layer.blob.size || got != layer.blob.digest {
        return Err(Error::Corrupt(format!(
            "{what}: {total} bytes with digest {got} arrived, {} bytes with digest {} expected",
            layer.blob.size, layer.blob.digest
        )));
    }
    written?;
    Ok(total)
}

/// A blocking reader of the chunks an async task sends.
struct ChannelReader {
    rx: mpsc::Receiver<Bytes>,
    cur: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(b) => self.cur = b,
                None => return Ok(0),
            }
        }
        let n = self.cur.len().min(buf.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

/// A pulled snapshot's state names the ids it had where it was taken;
/// here it has `id`, and its parent `parent`: rewrite them (twig-vmm finds
/// a parent by the id its child's state names, and checks its uid).
fn relabel(dir: &std::path::Path, id: &str, parent: Option<&str>) -> Result<()> {
    let mut state = twig_vmm::snapshot::read_state(dir).map_err(|e| Error::State(e.to_string()))?;
    let same_parent = match (&state.meta.parent, parent) {
        (None, None) => true,
        (Some(p), Some(q)) => p.id == q,
        _ => {
            return Err(Error::Corrupt(format!(
                "the state of {id} disagrees with its manifest about having a parent"
            )))
        }
    };
    if state.meta.id == id && same_parent {
        return Ok(());
    }
    state.meta.id = id.to_string();
    if let (Some(p), Some(q)) = (state.meta.parent.as_mut(), parent) {
        p.id = q.to_string();
    }
    let bytes = state.encode().map_err(|e| Error::State(e.to_string()))?;
    let path = dir.join(Artefact::State.file_name());
    twig_store::fsops::write_durable(&path, &bytes)
        .map_err(Error::local("rewriting a pulled state"))
}
