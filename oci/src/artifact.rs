//! How a snapshot looks as an OCI artifact: an image manifest (v1.1) whose
//! `artifactType` names it, whose config is the snapshot's store manifest,
//! whose layers are its artefacts (one blob each), and whose `subject` is
//! its parent's manifest.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use twig_store::{Artefact, Kind, Manifest};

use crate::client::OCI_MANIFEST;
use crate::error::{Error, Result};
use crate::reference::check_digest;

/// `artifactType` of a Twig snapshot.
pub const ARTIFACT_TYPE: &str = "application/vnd.twig.snapshot.v1";
/// The config blob: the snapshot's store manifest (JSON).
pub const CONFIG_TYPE: &str = "application/vnd.twig.snapshot.config.v1+json";
/// The `state` artefact, as written by twig-vmm.
pub const STATE_TYPE: &str = "application/vnd.twig.snapshot.state.v1";
/// A file as an extents blob of its non-zero pages.
pub const EXTENTS_TYPE: &str = "application/vnd.twig.snapshot.extents.v1";
/// A file as an extents blob of the pages in which it differs from the
/// same artefact of the parent snapshot.
pub const DELTA_TYPE: &str = "application/vnd.twig.snapshot.extents.delta.v1";
/// Layer annotation: which artefact a layer is (`state`, `memory`, `disk<i>`).
pub const ARTEFACT_ANNOTATION: &str = "dev.twig.artefact";
/// Extents layer annotation: where its blob's index starts (decimal).
pub const INDEX_AT_ANNOTATION: &str = "dev.twig.extents.index-at";
/// Extents layer annotation: `sha256:<hex>` of its blob's index and
/// footer (the bytes from the index to the blob's end).
pub const INDEX_DIGEST_ANNOTATION: &str = "dev.twig.extents.index-digest";
/// Store label of a snapshot pushed or pulled: its artifact's manifest
/// digest (what lets a node find the snapshots it already has).
pub const DIGEST_LABEL: &str = "twig.dev/oci-manifest";
/// Largest config blob accepted.
pub const MAX_CONFIG: usize = 1 << 20;
/// Most layers a snapshot may have (state, memory and disks).
const MAX_LAYERS: usize = 64;

/// An OCI content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Its media type.
    pub media_type: String,
    /// `sha256:<hex>`.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An OCI image manifest, as this crate writes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OciManifest {
    /// Always 2.
    pub schema_version: u32,
    /// [`OCI_MANIFEST`].
    pub media_type: String,
    /// [`ARTIFACT_TYPE`].
    #[serde(default)]
    pub artifact_type: Option<String>,
    /// The snapshot's store manifest.
    pub config: Descriptor,
    /// One per artefact.
    pub layers: Vec<Descriptor>,
    /// The parent snapshot's manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Descriptor>,
}

/// One layer of a checked manifest.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Which artefact.
    pub artefact: Artefact,
    /// Its blob.
    pub blob: Descriptor,
    /// A delta against the parent's same artefact.
    pub delta: bool,
    /// An extents blob's index: where it starts and its digest.
    pub index: Option<(u64, String)>,
}

impl OciManifest {
    /// Parses and checks a pulled manifest: a Twig snapshot, digests well
    /// formed, each layer a known artefact once, deltas only with a parent.
    pub fn parse(bytes: &[u8]) -> Result<(OciManifest, Vec<Layer>)> {
        let bad = |why: String| Error::Corrupt(format!("snapshot manifest: {why}"));
        let m: OciManifest =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not an OCI manifest: {e}")))?;
        if m.schema_version != 2 || m.media_type != OCI_MANIFEST {
            return Err(bad("not an OCI image manifest".into()));
        }
        if m.artifact_type.as_deref() != Some(ARTIFACT_TYPE) || m.config.media_type != CONFIG_TYPE {
            return Err(bad(format!(
                "not a Twig snapshot (artifactType {:?})",
                m.artifact_type
            )));
        }
        check_digest(&m.config.digest)?;
        if m.config.size > MAX_CONFIG as u64 {
            return Err(bad(format!("its config is {} bytes", m.config.size)));
        }
        if let Some(s) = &m.subject {
            check_digest(&s.digest)?;
        }
        if m.layers.is_empty() || m.layers.len() > MAX_LAYERS {
            return Err(bad(format!("{} layers", m.layers.len())));
        }
        let mut layers: Vec<Layer> = Vec::new();
        for l in &m.layers {
            check_digest(&l.digest)?;
            let name = l
                .annotations
                .get(ARTEFACT_ANNOTATION)
                .map(String::as_str)
                .unwrap_or("");
            let artefact = Artefact::from_file_name(name)
                .ok_or_else(|| bad(format!("layer {} is no artefact ({name:?})", l.digest)))?;
            let delta = match (l.media_type.as_str(), artefact) {
                (STATE_TYPE, Artefact::State) => false,
                (EXTENTS_TYPE, a) if a != Artefact::State => false,
                (DELTA_TYPE, a) if a != Artefact::State && m.subject.is_some() => true,
                (t, a) => return Err(bad(format!("layer {a} has media type {t:?}"))),
            };
            if layers.iter().any(|x| x.artefact == artefact) {
                return Err(bad(format!("artefact {artefact} twice")));
            }
            let index = match (
                l.annotations.get(INDEX_AT_ANNOTATION),
                l.annotations.get(INDEX_DIGEST_ANNOTATION),
            ) {
                (Some(at), Some(digest)) if artefact != Artefact::State => {
                    check_digest(digest)?;
                    let at = at
                        .parse::<u64>()
                        .ok()
                        .filter(|a| *a < l.size)
                        .ok_or_else(|| bad(format!("layer {artefact}: index at {at:?}")))?;
                    Some((at, digest.clone()))
                }
                (None, None) => None,
                _ => {
                    return Err(bad(format!(
                        "layer {artefact}: a malformed index annotation"
                    )))
                }
            };
            layers.push(Layer {
                artefact,
                blob: l.clone(),
                delta,
                index,
            });
        }
        Ok((m, layers))
    }
}

/// Parses and checks a pulled config against the manifest's layers and
/// parent.
pub fn parse_config(bytes: &[u8], layers: &[Layer], has_parent: bool) -> Result<Manifest> {
    let bad = |why: String| Error::Corrupt(format!("snapshot config: {why}"));
    let c: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(format!("malformed: {e}")))?;
    twig_store::layout::validate_id(&c.id).map_err(|e| bad(e.to_string()))?;
    if let Some(o) = &c.owner {
        twig_store::layout::validate_owner(o).map_err(|e| bad(e.to_string()))?;
    }
    match (c.kind, has_parent) {
        (Kind::Full, false) | (Kind::Incremental, true) => {}
        (k, p) => {
            return Err(bad(format!(
                "a {k:?} snapshot {} a parent",
                if p { "with" } else { "without" }
            )))
        }
    }
    let named: Vec<&String> = c.artefacts.keys().collect();
    let carried: Vec<String> = {
        let mut v: Vec<String> = layers.iter().map(|l| l.artefact.file_name()).collect();
        v.sort();
        v
    };
    if named.len() != carried.len() || named.iter().zip(&carried).any(|(a, b)| *a != b) {
        return Err(bad(format!(
            "it names artefacts {named:?}, the layers carry {carried:?}"
        )));
    }
    Ok(c)
}

/// The config of a published snapshot: its store manifest without the
/// label this crate adds.
pub fn config_of(s: &twig_store::VmSnapshot) -> Manifest {
    let mut labels = s.labels.clone();
    labels.remove(DIGEST_LABEL);
    Manifest {
        id: s.id.clone(),
        parent: s.parent.clone(),
        kind: s.kind,
        created: s.created,
        labels,
        owner: s.owner.clone(),
        artefacts: s
            .artefacts
            .iter()
            .map(|(a, n)| (a.file_name(), *n))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(t: &str, artefact: Option<&str>) -> Descriptor {
        Descriptor {
            media_type: t.into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: 1,
            annotations: artefact
                .map(|a| [(ARTEFACT_ANNOTATION.to_string(), a.to_string())].into())
                .unwrap_or_default(),
        }
    }

    fn manifest(layers: Vec<Descriptor>, subject: bool) -> Vec<u8> {
        serde_json::to_vec(&OciManifest {
            schema_version: 2,
            media_type: OCI_MANIFEST.into(),
            artifact_type: Some(ARTIFACT_TYPE.into()),
            config: desc(CONFIG_TYPE, None),
            layers,
            subject: subject.then(|| desc(OCI_MANIFEST, None)),
        })
        .unwrap()
    }

    #[test]
    fn snapshot_manifests_are_checked() {
        let ok = manifest(
            vec![
                desc(STATE_TYPE, Some("state")),
                desc(DELTA_TYPE, Some("disk0")),
            ],
            true,
        );
        let (_, layers) = OciManifest::parse(&ok).unwrap();
        assert!(layers[1].delta);
        for (bad, why) in [
            (
                manifest(vec![desc(DELTA_TYPE, Some("memory"))], false),
                "media type",
            ),
            (
                manifest(vec![desc(EXTENTS_TYPE, Some("../x"))], false),
                "no artefact",
            ),
            (
                manifest(vec![desc(STATE_TYPE, Some("memory"))], false),
                "media type",
            ),
            (
                manifest(
                    vec![
                        desc(STATE_TYPE, Some("state")),
                        desc(STATE_TYPE, Some("state")),
                    ],
                    false,
                ),
                "twice",
            ),
            (manifest(vec![], false), "0 layers"),
            (b"{}".to_vec(), "not an OCI manifest"),
        ] {
            let e = OciManifest::parse(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        let image = String::from_utf8(ok)
            .unwrap()
            .replace(ARTIFACT_TYPE, "application/vnd.oci.image.config.v1+json");
        assert!(OciManifest::parse(image.as_bytes())
            .unwrap_err()
            .to_string()
            .contains("not a Twig snapshot"));
    }
}
