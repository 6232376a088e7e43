//! Lazy pulls: a snapshot a node lacks, restored before its memory has
//! arrived. [`pull_lazy`] resolves the chain as [`pull`](crate::pull)
//! does, stages everything but the memory of each snapshot the store
//! lacks (state with its ids rewritten, disks) and fetches and verifies
//! each memory blob's index; the VM restores from the leaf's staging
//! directory ([`LazyPull::dir`]) and its memory is served from the
//! [`PageSource`], by verified range from the registry until the
//! download ([`LazyPull::finish`]) has written it. `finish` publishes the
//! chain as an eager pull would, or nothing: a failed lazy pull leaves no
//! snapshot of its chain and no staging behind.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::num::NonZeroU64;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use twig_store::{Artefact, CloneMode, Kind, NodeStore, Staging};

use crate::client::{digest_of, Client};
use crate::error::{Error, Result};
use crate::extents::Index;
use crate::pagesource::{Backing, Fetcher, Layer as MemLayer, Remote};
use crate::pull::{
    fetch, id_for, local_owned, publish, resolve, stage, ParentAt, Pending, Pulled, Resolved, Watch,
};
use crate::reference::Reference;

pub use crate::pagesource::{PageSource, PAGE};

/// A snapshot being pulled lazily: staged, its memory to come.
pub struct LazyPull {
    /// The leaf's staging directory, described to the store
    /// ([`NodeStore::staged`]): its `state` and disks, what a VM's lazy
    /// restore reads. (The store's published directory when the store had
    /// the snapshot already: see [`LazyPull::is_staged`].) A leaf whose
    /// parent is staged too is described without it: the store names
    /// published parents only; it gets it when published.
    pub dir: PathBuf,
    /// The id it will be published under.
    pub id: String,
    /// The leaf's guest memory, composed across the chain.
    pub source: Arc<PageSource>,
    /// The pages the leaf's guest was using when it was snapshotted, as
    /// runs `(first page, count)` inside its memory (its state's hot
    /// list, checked when read): what a lazy restore wants first. Empty
    /// when the store had the snapshot.
    pub hot: Vec<(u64, u64)>,
    pending: Option<Download>,
    out: Pulled,
}

/// What [`LazyPull::finish`] still has to do.
struct Download {
    store: &'static NodeStore,
    client: Client,
    from: Reference,
    /// The store's snapshot the chain continues.
    base: Option<String>,
    /// Root first.
    steps: Vec<Step>,
}

struct Step {
    staging: Staging<'static>,
    id: String,
    kind: Kind,
    /// Its parent is staged by this pull: named at publication.
    parent_staged: bool,
    memory: crate::artifact::Layer,
    expected: u64,
    /// Its layer in the page source.
    layer: usize,
}

impl LazyPull {
    /// Whether the snapshot is staged (pulled now) rather than one the
    /// store already had (then `finish` has nothing to do).
    pub fn is_staged(&self) -> bool {
        self.pending.is_some()
    }

    /// Downloads each staged snapshot's memory in full (its digest checked,
    /// each record against the index the page source verified, which then
    /// serves what is written from the file), then publishes the chain
    /// root first, as [`pull`](crate::pull) would have. On an error
    /// nothing of the chain is published (what this pull published is
    /// deleted again) and the stagings are dropped.
    pub async fn finish(self) -> Result<Pulled> {
        self.finish_paced(None).await
    }

    /// [`LazyPull::finish`], downloading at most `pace` bytes a second:
    /// the background download leaves the registry link to the ranges a
    /// running guest faults in (which are never paced). The pace is this
    /// download's: N lazy restores at once take up to N times it.
    pub async fn finish_paced(self, pace: Option<NonZeroU64>) -> Result<Pulled> {
        let LazyPull {
            source,
            pending,
            mut out,
            ..
        } = self;
        let Some(d) = pending else {
            return Ok(out);
        };
        let mut steps = d.steps;
        for s in &mut steps {
            let dest = s.staging.path(Artefact::Memory);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&dest)
                .map_err(Error::local("creating a pulled memory file"))?;
            let remote = source
                .remote(s.layer)
                .ok_or_else(|| Error::Invalid(format!("snapshot {}: no remote memory", s.id)))?
                .clone();
            remote.decoding_into(
                file.try_clone()
                    .map_err(Error::local("opening a pulled memory file"))?,
            );
            let watch = Watch {
                index: remote.index.clone(),
                written: Box::new(move |i| remote.written(i)),
                pace,
            };
            out.bytes_downloaded +=
                fetch(&d.client, &d.from, &s.memory, file, s.expected, Some(watch)).await?;
        }
        let mut parent = d.base;
        let mut published: Vec<String> = Vec::new();
        for s in steps {
            let Step {
                mut staging,
                id,
                kind,
                parent_staged,
                ..
            } = s;
            let done = (|| -> Result<bool> {
                if parent_staged {
                    let p = parent.as_deref().unwrap_or_default();
                    staging.set_parent(p)?;
                    staging.set_kind(kind);
                }
                publish(staging, &id)
            })();
            match done {
                Ok(mine) => {
                    if mine {
                        published.push(id.clone());
                    }
                    out.snapshots_pulled += 1;
                    parent = Some(id);
                }
                Err(e) => {
                    unpublish(d.store, &published);
                    return Err(e);
                }
            }
        }
        out.id = parent.unwrap_or_default();
        tracing::info!(from = %d.from, id = %out.id, bytes = out.bytes_downloaded,
            fetched = source.bytes_fetched(), "lazy pull finished");
        Ok(out)
    }
}

/// Deletes, newest first, the snapshots a failed lazy pull published.
fn unpublish(store: &NodeStore, ids: &[String]) {
    for id in ids.iter().rev() {
        if let Err(e) = store.delete(id) {
            tracing::warn!(id, error = %e, "a failed lazy pull could not take back a snapshot");
        }
    }
}

/// Starts pulling `from` (and the parents the store lacks) into `store`
/// lazily: see the module. The snapshot must belong to `owner`, checked
/// before anything is downloaded, as [`pull`](crate::pull) does. The page
/// source fetches on the runtime this is called on.
pub async fn pull_lazy(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
) -> Result<LazyPull> {
    lazy_into(client, store, from, owner, None).await
}

/// [`pull_lazy`], the snapshot published as `id`, as
/// [`pull_as`](crate::pull_as) does.
pub async fn pull_lazy_as(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
    id: &str,
) -> Result<LazyPull> {
    twig_store::layout::validate_id(id)?;
    lazy_into(client, store, from, owner, Some(id)).await
}

async fn lazy_into(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    owner: Option<&str>,
    leaf_id: Option<&str>,
) -> Result<LazyPull> {
    let store = shared(store)?;
    let Resolved {
        digest,
        parent: base,
        mut pending,
    } = resolve(client, store, from, owner, leaf_id).await?;
    let mut out = Pulled {
        digest,
        ..Default::default()
    };
    let fetcher = Fetcher {
        client: client.clone(),
        from: from.clone(),
        rt: tokio::runtime::Handle::current(),
    };
    if pending.is_empty() {
        let id = local_owned(store, base, owner)?;
        let layers = local_layers(&store.snapshot_dir(&id))?;
        let mem_size = mem_size_of(&layers, &id)?;
        out.id = id.clone();
        return Ok(LazyPull {
            dir: store.snapshot_dir(&id),
            id,
            source: Arc::new(PageSource::new(mem_size, layers, fetcher)),
            hot: Vec::new(),
            pending: None,
            out,
        });
    }
    let mut layers = match &base {
        Some(b) => local_layers(&store.snapshot_dir(b))?,
        None => Vec::new(),
    };
    let mut steps: Vec<Step> = Vec::new();
    let mut mem_size = None;
    let mut hot = Vec::new();
    while let Some(p) = pending.pop() {
        let id = id_for(&p.digest, leaf_id.filter(|_| pending.is_empty()));
        let at = match (steps.last(), &base) {
            (Some(s), _) => Some(ParentAt {
                id: &s.id,
                dir: s.staging.dir().to_path_buf(),
                published: false,
            }),
            (None, Some(b)) => Some(ParentAt {
                id: b,
                dir: store.snapshot_dir(b),
                published: true,
            }),
            (None, None) => None,
        };
        let staging = stage(client, store, from, &id, &p, at.as_ref(), true, &mut out).await?;
        let parent_staged = at.is_some_and(|a| !a.published);
        let state = twig_vmm::snapshot::read_state(staging.dir())
            .map_err(|e| Error::State(format!("snapshot {id}: {e}")))?;
        let size = *mem_size.get_or_insert(state.meta.mem_size);
        if state.meta.mem_size != size || size % PAGE != 0 {
            return Err(Error::Corrupt(format!(
                "snapshot {id}: {} bytes of guest memory in a chain of {size}",
                state.meta.mem_size
            )));
        }
        hot = state.meta.hot;
        let (memory, expected, index) = memory_index(client, from, &p, size).await?;
        out.bytes_downloaded += index.1;
        layers.push(MemLayer {
            id: id.clone(),
            pages: state.layer.as_ref().map(|l| l.words().to_vec()),
            backing: Backing::Remote(Arc::new(Remote::new(memory.blob.digest.clone(), index.0))),
        });
        steps.push(Step {
            staging,
            id,
            kind: p.config.kind,
            parent_staged,
            memory,
            expected,
            layer: layers.len() - 1,
        });
    }
    let leaf = steps
        .last()
        .ok_or_else(|| Error::Invalid("nothing to pull".into()))?;
    leaf.staging.describe()?;
    let mem_size = mem_size_of(&layers, &leaf.id)?;
    let (dir, id) = (leaf.staging.dir().to_path_buf(), leaf.id.clone());
    tracing::info!(from = %from, id, snapshots = steps.len(), bytes = out.bytes_downloaded,
        "lazy pull staged: memory to come");
    Ok(LazyPull {
        dir,
        id,
        source: Arc::new(PageSource::new(mem_size, layers, fetcher)),
        hot,
        pending: Some(Download {
            store,
            client: client.clone(),
            from: from.clone(),
            base,
            steps,
        }),
        out,
    })
}

/// Snapshot `p`'s memory layer, its file's length and its index (with the
/// bytes fetched for it): fetched by range and checked against the digest
/// the manifest gives.
async fn memory_index(
    client: &Client,
    from: &Reference,
    p: &Pending,
    mem_size: u64,
) -> Result<(crate::artifact::Layer, u64, (Index, u64))> {
    let what = |why: &str| Error::Corrupt(format!("snapshot {}: {why}", p.digest));
    let layer = p
        .layers
        .iter()
        .find(|l| l.artefact == Artefact::Memory)
        .ok_or_else(|| what("no memory layer"))?;
    let expected = p
        .config
        .artefacts
        .get("memory")
        .copied()
        .unwrap_or_default();
    if expected != mem_size {
        return Err(what(&format!(
            "a {expected}-byte memory file for {mem_size} bytes of guest memory"
        )));
    }
    let (at, digest) = layer.index.clone().ok_or_else(|| {
        what("its memory blob has no verified index (pushed by an older twig: push it again)")
    })?;
    let size = layer.blob.size;
    if size - at > crate::extents::MAX_INDEX {
        return Err(what(&format!("a memory index of {} bytes", size - at)));
    }
    let tail = client
        .blob_range(from, &layer.blob.digest, at, size - at)
        .await?;
    if digest_of(&tail) != digest {
        return Err(Error::Corrupt(format!(
            "blob {}: its index arrived with digest {}, the manifest says {digest}",
            layer.blob.digest,
            digest_of(&tail)
        )));
    }
    let index = Index::parse(&tail, at, size, expected)
        .map_err(|e| Error::Corrupt(format!("blob {}: {e}", layer.blob.digest)))?;
    Ok((layer.clone(), expected, (index, tail.len() as u64)))
}

/// The memory layers of the store's snapshot in `dir` and its parents,
/// root first (twig-vmm opens and checks the chain).
fn local_layers(dir: &std::path::Path) -> Result<Vec<MemLayer>> {
    let image = twig_vmm::snapshot::Image::open(dir)
        .map_err(|e| Error::State(format!("{}: {e}", dir.display())))?;
    Ok(image
        .chain()
        .iter()
        .map(|i| MemLayer {
            id: i.id().to_string(),
            pages: i.state.layer.as_ref().map(|l| l.words().to_vec()),
            backing: Backing::Local(i.memory.clone()),
        })
        .collect())
}

fn mem_size_of(layers: &[MemLayer], id: &str) -> Result<u64> {
    let sizes: Vec<u64> = layers
        .iter()
        .filter_map(|l| match &l.backing {
            Backing::Local(f) => f.metadata().ok().map(|m| m.len()),
            Backing::Remote(r) => Some(r.index.length),
        })
        .collect();
    match sizes.first() {
        Some(&s) if s % PAGE == 0 && sizes.iter().all(|x| *x == s) => Ok(s),
        _ => Err(Error::Corrupt(format!(
            "snapshot {id}: its chain's memory sizes disagree ({sizes:?})"
        ))),
    }
}

/// Stores by root, for the process's life. A staging borrows its store
/// and a lazy pull outlives its caller's borrow (its download runs on a
/// task of its own): it stages through a handle of the same store kept
/// here, one per store root (so their staging names never collide).
fn shared_stores() -> &'static Mutex<HashMap<PathBuf, &'static NodeStore>> {
    static STORES: OnceLock<Mutex<HashMap<PathBuf, &'static NodeStore>>> = OnceLock::new();
    STORES.get_or_init(Default::default)
}

fn shared(store: &NodeStore) -> Result<&'static NodeStore> {
    let mut stores = shared_stores().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = stores.get(store.root()) {
        return Ok(s);
    }
    let opened = NodeStore::open(store.root(), store.clone_mode() == CloneMode::Copy)?;
    let s: &'static NodeStore = Box::leak(Box::new(opened));
    stores.insert(store.root().to_path_buf(), s);
    Ok(s)
}
