//! Pushing a snapshot and its parents: each snapshot one manifest, each
//! artefact one blob, uploaded only when the registry lacks it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::PathBuf;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use twig_store::{Artefact, Kind, NodeStore, VmSnapshot};

use crate::artifact::{
    config_of, Descriptor, OciManifest, ARTEFACT_ANNOTATION, ARTIFACT_TYPE, CONFIG_TYPE,
    DELTA_TYPE, DIGEST_LABEL, EXTENTS_TYPE, INDEX_AT_ANNOTATION, INDEX_DIGEST_ANNOTATION,
    STATE_TYPE,
};
use crate::client::{digest_of, hex, Client, OCI_MANIFEST};
use crate::error::{Error, Result};
use crate::extents::Plan;
use crate::reference::Reference;
use crate::MAX_CHAIN;

/// Bytes per upload request.
const CHUNK: usize = 8 << 20;

/// What a push did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pushed {
    /// The pushed snapshot's manifest digest (what its tag names).
    pub digest: String,
    /// Snapshots of the chain whose manifest was pushed.
    pub snapshots_pushed: usize,
    /// Snapshots of the chain the registry already had.
    pub snapshots_present: usize,
    /// Blobs uploaded.
    pub blobs_uploaded: usize,
    /// Blobs the registry already had.
    pub blobs_present: usize,
    /// Bytes uploaded, in blobs.
    pub bytes_uploaded: u64,
}

/// Pushes snapshot `id` of `store`, and every parent the registry lacks,
/// to `to`'s repository; `to`'s tag names the snapshot. Each snapshot
/// pushed is labelled with its manifest digest in the store.
pub async fn push(client: &Client, store: &NodeStore, id: &str, to: &Reference) -> Result<Pushed> {
    let Some(tag) = to.tag.clone().filter(|_| to.digest.is_none()) else {
        return Err(Error::Invalid(format!(
            "push to {to}: name the snapshot by a tag (a digest is what the push computes)"
        )));
    };
    let mut chain = vec![store.get(id)?];
    while let Some(p) = chain.last().and_then(|s| s.parent.clone()) {
        if chain.len() > MAX_CHAIN {
            return Err(Error::Invalid(format!(
                "snapshot {id}: its chain is longer than {MAX_CHAIN}"
            )));
        }
        chain.push(store.get(&p)?);
    }
    let mut out = Pushed::default();
    let mut subject: Option<Descriptor> = None;
    let mut last: Option<(Bytes, String)> = None;
    for (i, snap) in chain.iter().enumerate().rev() {
        let parent = chain.get(i + 1);
        // Present as pushed, unless its parent was pushed anew now (its
        // subject changed) or it was pushed in the format before range
        // indexes (then it is pushed again, under a new digest).
        let label = snap
            .labels
            .get(DIGEST_LABEL)
            .filter(|_| out.snapshots_pushed == 0);
        if let Some(d) = label {
            if client.has_manifest(to, d).await? {
                let (bytes, digest) = client.manifest(to, d).await?;
                if indexed(&bytes) {
                    subject = Some(manifest_descriptor(&digest, bytes.len()));
                    last = Some((Bytes::from(bytes), digest));
                    out.snapshots_present += 1;
                    continue;
                }
                tracing::info!(
                    id = snap.id,
                    digest,
                    "pushed before range indexes: pushing it again"
                );
            }
        }
        let (bytes, digest) = push_one(client, to, snap, parent, subject.take(), &mut out).await?;
        store.set_label(&snap.id, DIGEST_LABEL, Some(&digest))?;
        subject = Some(manifest_descriptor(&digest, bytes.len()));
        last = Some((bytes, digest));
        out.snapshots_pushed += 1;
    }
    let (bytes, digest) =
        last.ok_or_else(|| Error::Invalid(format!("snapshot {id}: nothing to push")))?;
    client.put_manifest(to, &tag, bytes).await?;
    out.digest = digest;
    tracing::info!(id, to = %to, digest = %out.digest, bytes = out.bytes_uploaded, "snapshot pushed");
    Ok(out)
}

/// Whether every extents layer of a pushed manifest has its range index.
fn indexed(manifest: &[u8]) -> bool {
    OciManifest::parse(manifest).is_ok_and(|(_, layers)| {
        layers
            .iter()
            .all(|l| l.artefact == Artefact::State || l.index.is_some())
    })
}

fn manifest_descriptor(digest: &str, size: usize) -> Descriptor {
    Descriptor {
        media_type: OCI_MANIFEST.into(),
        digest: digest.into(),
        size: size as u64,
        annotations: Default::default(),
    }
}

/// Where one blob's bytes come from.
#[derive(Clone)]
enum Source {
    /// A file as it is (the state).
    Raw(PathBuf),
    /// A file as an extents blob (against a base, or zeros).
    Extents(PathBuf, Plan),
}

impl Source {
    /// Calls `f` with each chunk of the blob, in order; returns an
    /// extents blob's index digest.
    fn each_chunk(&self, mut f: impl FnMut(Vec<u8>) -> bool) -> io::Result<Option<String>> {
        match self {
            Source::Raw(p) => chunks(File::open(p)?, &mut f).map(|()| None),
            Source::Extents(p, plan) => {
                let file = File::open(p)?;
                let mut reader = plan.reader(&file);
                chunks(&mut reader, &mut f)?;
                Ok(reader.index_digest().map(str::to_string))
            }
        }
    }
}

fn chunks(mut r: impl Read, f: &mut impl FnMut(Vec<u8>) -> bool) -> io::Result<()> {
    loop {
        let mut buf = vec![0u8; CHUNK];
        let mut n = 0;
        while n < CHUNK {
            match r.read(&mut buf[n..])? {
                0 => break,
                k => n += k,
            }
        }
        if n == 0 {
            return Ok(());
        }
        buf.truncate(n);
        if !f(buf) {
            return Ok(());
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
    what: &str,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Local {
            what: what.to_string(),
            source: io::Error::other(e.to_string()),
        })?
        .map_err(Error::local(what))
}

/// Pushes one snapshot's blobs and manifest (by digest); returns the
/// manifest and its digest.
async fn push_one(
    client: &Client,
    to: &Reference,
    snap: &VmSnapshot,
    parent: Option<&VmSnapshot>,
    subject: Option<Descriptor>,
    out: &mut Pushed,
) -> Result<(Bytes, String)> {
    let mut layers = Vec::new();
    for &artefact in snap.artefacts.keys() {
        let path = snap.dir().join(artefact.file_name());
        let base = match (artefact, snap.kind) {
            (Artefact::Disk(_), Kind::Incremental) => parent.and_then(|p| p.path(artefact)),
            _ => None,
        };
        let (media_type, source) = match artefact {
            Artefact::State => (STATE_TYPE, Source::Raw(path)),
            _ => {
                let what = format!("comparing {} of snapshot {}", artefact, snap.id);
                let p = path.clone();
                let b = base.clone();
                let plan = blocking(
                    move || {
                        let file = File::open(&p)?;
                        let base = b.map(File::open).transpose()?;
                        Plan::of(&file, base.as_ref())
                    },
                    &what,
                )
                .await?;
                let t = if base.is_some() {
                    DELTA_TYPE
                } else {
                    EXTENTS_TYPE
                };
                (t, Source::Extents(path, plan))
            }
        };
        let hashing = source.clone();
        let (digest, size, index) = blocking(
            move || {
                let mut h = Sha256::new();
                let mut size = 0u64;
                let index = hashing.each_chunk(|c| {
                    size += c.len() as u64;
                    h.update(&c);
                    true
                })?;
                Ok((format!("sha256:{}", hex(&h.finalize())), size, index))
            },
            &format!("reading {} of snapshot {}", artefact, snap.id),
        )
        .await?;
        let mut annotations: BTreeMap<String, String> =
            [(ARTEFACT_ANNOTATION.to_string(), artefact.file_name())].into();
        if let (Source::Extents(_, plan), Some(index)) = (&source, index) {
            // The manifest vouches for the index, the index for each
            // record: a range fetched alone is verified (lazy restore).
            annotations.insert(INDEX_AT_ANNOTATION.into(), plan.index_at().to_string());
            annotations.insert(INDEX_DIGEST_ANNOTATION.into(), index);
        }
        upload(client, to, &digest, size, Some(source), None, out).await?;
        layers.push(Descriptor {
            media_type: media_type.into(),
            digest,
            size,
            annotations,
        });
    }
    let config = Bytes::from(
        serde_json::to_vec(&config_of(snap))
            .map_err(|e| Error::Invalid(format!("encoding the config of {}: {e}", snap.id)))?,
    );
    let config_digest = digest_of(&config);
    upload(
        client,
        to,
        &config_digest,
        config.len() as u64,
        None,
        Some(config.clone()),
        out,
    )
    .await?;
    let manifest = OciManifest {
        schema_version: 2,
        media_type: OCI_MANIFEST.into(),
        artifact_type: Some(ARTIFACT_TYPE.into()),
        config: Descriptor {
            media_type: CONFIG_TYPE.into(),
            digest: config_digest,
            size: config.len() as u64,
            annotations: Default::default(),
        },
        layers,
        subject,
    };
    let bytes = Bytes::from(
        serde_json::to_vec(&manifest)
            .map_err(|e| Error::Invalid(format!("encoding a manifest: {e}")))?,
    );
    let digest = digest_of(&bytes);
    client.put_manifest(to, &digest, bytes.clone()).await?;
    Ok((bytes, digest))
}

/// Uploads a blob unless the registry has it: from `source`, read on a
/// blocking thread as it is sent, or from `bytes`.
async fn upload(
    client: &Client,
    to: &Reference,
    digest: &str,
    size: u64,
    source: Option<Source>,
    bytes: Option<Bytes>,
    out: &mut Pushed,
) -> Result<()> {
    if client.has_blob(to, digest).await? {
        out.blobs_present += 1;
        return Ok(());
    }
    let (tx, rx) = mpsc::channel(2);
    match (source, bytes) {
        // Read on a blocking thread as it is sent; it stops when the
        // upload does (its sends fail).
        (Some(s), _) => drop(tokio::task::spawn_blocking(move || {
            if let Err(e) = s.each_chunk(|c| tx.blocking_send(Ok(Bytes::from(c))).is_ok()) {
                // The upload sees the error instead of a short blob.
                let _ = tx.blocking_send(Err(e));
            }
        })),
        (None, b) => {
            if let Some(b) = b {
                tx.send(Ok(b))
                    .await
                    .map_err(|_| Error::Transfer("the upload ended early".into()))?;
            }
            drop(tx);
        }
    }
    let sent = client.upload(to, digest, size, rx).await;
    sent?;
    out.blobs_uploaded += 1;
    out.bytes_uploaded += size;
    Ok(())
}
