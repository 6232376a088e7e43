//! Pulling a snapshot and the parents the node lacks: each into a staging
//! directory of the node store, its blobs' digests checked as they
//! stream, published only whole.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use twig_store::{Artefact, Manifest, NodeStore};

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
    let (bytes, digest) = client.manifest(from, from.target()).await?;
    let mut out = Pulled {
        digest: digest.clone(),
        ..Default::default()
    };
    let mut pending: Vec<(String, OciManifest, Vec<Layer>, Manifest)> = Vec::new();
    let mut cur = (bytes, digest);
    let mut parent = loop {
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
        pending.push((cur.1, m, layers, config));
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
    if pending.is_empty() {
        let id = parent.unwrap_or_default();
        store.get(&id)?.check_owner(owner).map_err(|e| match e {
            twig_store::Error::PermissionDenied(m) => Error::PermissionDenied(m),
            e => e.into(),
        })?;
        out.id = id;
        return Ok(out);
    }
    while let Some((digest, _, layers, config)) = pending.pop() {
        let id = match leaf_id.filter(|_| pending.is_empty()) {
            Some(id) => id.to_string(),
            None => pulled_id(&digest),
        };
        let id = import(
            client,
            store,
            from,
            &id,
            &digest,
            &layers,
            &config,
            parent.as_deref(),
            &mut out,
        )
        .await?;
        out.snapshots_pulled += 1;
        parent = Some(id);
    }
    out.id = parent.unwrap_or_default();
    tracing::info!(from = %from, id = %out.id, bytes = out.bytes_downloaded, "snapshot pulled");
    Ok(out)
}

/// Pulls one snapshot whose parent (if any) is `parent` in the store.
#[allow(clippy::too_many_arguments)]
async fn import(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    id: &str,
    digest: &str,
    layers: &[Layer],
    config: &Manifest,
    parent: Option<&str>,
    out: &mut Pulled,
) -> Result<String> {
    let mut staging = store.stage(id)?;
    if let Some(p) = parent {
        staging.set_parent(p)?;
    }
    staging.set_kind(config.kind);
    if let Some(o) = &config.owner {
        staging.set_owner(o)?;
    }
    for (k, v) in &config.labels {
        staging.set_label(k, v);
    }
    staging.set_label(DIGEST_LABEL, digest);
    for layer in layers {
        let name = layer.artefact.file_name();
        let expected = config.artefacts.get(&name).copied().unwrap_or_default();
        let dest = staging.path(layer.artefact);
        if layer.delta {
            let base = parent
                .map(|p| store.get(p))
                .transpose()?
                .and_then(|p| p.path(layer.artefact))
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
        let got = fetch(client, from, layer, file, expected).await?;
        out.bytes_downloaded += got;
    }
    relabel(staging.dir(), id, parent)?;
    match staging.publish() {
        Ok(_) => Ok(id.to_string()),
        // Pulled at the same time by another caller: the same content.
        Err(twig_store::Error::AlreadyExists(_)) if id.starts_with(PULLED_PREFIX) => {
            Ok(id.to_string())
        }
        Err(e) => Err(e.into()),
    }
}

/// Streams one layer's blob into `file`, checking its size and digest;
/// returns the bytes downloaded.
async fn fetch(
    client: &Client,
    from: &Reference,
    layer: &Layer,
    file: File,
    expected: u64,
) -> Result<u64> {
    let what = format!("blob {} ({})", layer.blob.digest, layer.artefact);
    let state = layer.artefact == Artefact::State;
    let limit = if state { MAX_STATE } else { MAX_FILE };
    if expected > limit || (state && expected != layer.blob.size) {
        return Err(Error::Corrupt(format!(
            "{what}: {expected} bytes is not a size it may have"
        )));
    }
    let resp = client.blob(from, &layer.blob.digest).await?;
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
