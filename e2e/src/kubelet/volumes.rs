//! A pod's volumes laid out on the node as kubelet lays them out, under
//! its root directory: `<root>/pods/<uid>/volumes/kubernetes.io~<plugin>/<volume>`
//! for `configmap`, `secret`, `projected`, `downward-api` and `empty-dir`
//! (`pkg/volume/*`). The first four are written by the atomic writer
//! ([`super::atomic`]) from the objects in the API server and rewritten
//! when those change; `secret`, `projected` and `downward-api` are tmpfs
//! mounts when the kubelet runs as root (kubelet wraps them in a
//! memory-backed emptyDir), as is an emptyDir of `medium: Memory` (sized by
//! its `sizeLimit`). `hostPath` is the host's path. Each `volumeMount`
//! becomes a CRI mount (`makeMounts` in `pkg/kubelet/kubelet_pods.go`);
//! ConfigMap, Secret, projected and downward API volumes are read-only
//! whatever the mount says; a `subPath` is bind-mounted (as root) at
//! `<root>/pods/<uid>/volume-subpaths/<volume>/<container>/<index>`.
//!
//! The default ServiceAccount token volume is injected as the
//! ServiceAccount admission plugin injects it (see
//! [`inject_service_account_volume`]); its token is minted here, shaped like
//! a service account JWT but signed by nobody (the testkit has no
//! TokenRequest), and re-minted every rotation period.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapProjection, Container, DownwardAPIVolumeFile, KeyToPath, Pod, Secret,
    SecretProjection, Volume, VolumeMount,
};
use twig_cri::api;

use super::atomic::{FileProjection, Payload};
use super::random_u32;

/// Where the ServiceAccount token volume is mounted.
pub const TOKEN_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The prefix of the token volume's name.
pub const TOKEN_VOLUME_PREFIX: &str = "kube-api-access-";
/// The ConfigMap every namespace has with the cluster's CA.
pub const ROOT_CA_CONFIG_MAP: &str = "kube-root-ca.crt";
/// The token's lifetime the admission plugin asks for.
const TOKEN_EXPIRATION_SECONDS: i64 = 3607;
/// kubelet's default file mode of configuration volumes (0644).
const DEFAULT_MODE: u32 = 0o644;

/// The ConfigMaps and Secrets of the pod's namespace.
pub trait Lookup {
    /// The ConfigMap `name`.
    fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>>;
    /// The Secret `name`.
    fn secret(&self, name: &str) -> Option<Arc<Secret>>;
}

/// Adds the ServiceAccount token volume and its mount at
/// [`TOKEN_MOUNT_PATH`] to every container that mounts nothing there, as
/// the ServiceAccount admission plugin does, unless the pod (or else its
/// ServiceAccount, `account_automount`) opts out, or it has one already.
/// Also defaults `serviceAccountName` to `default`.
pub fn inject_service_account_volume(pod: &mut Pod, account_automount: Option<bool>) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    if spec
        .service_account_name
        .as_deref()
        .unwrap_or_default()
        .is_empty()
    {
        spec.service_account_name = Some("default".into());
    }
    if spec.automount_service_account_token.or(account_automount) == Some(false) {
        return;
    }
    let has = |c: &Container| {
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == TOKEN_MOUNT_PATH)
    };
    if spec
        .volumes
        .iter()
        .flatten()
        .any(|v| v.name.starts_with(TOKEN_VOLUME_PREFIX))
    {
        return;
    }
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let suffix: String = (0..5)
        .map(|_| ALPHABET[random_u32() as usize % ALPHABET.len()] as char)
        .collect();
    let name = format!("{TOKEN_VOLUME_PREFIX}{suffix}");
    let volume: Volume = match serde_json::from_value(serde_json::json!({
        "name": name,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": TOKEN_EXPIRATION_SECONDS, "path": "token"}},
                {"configMap": {"name": ROOT_CA_CONFIG_MAP, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace",
                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
            ],
        },
    })) {
        Ok(v) => v,
        Err(e) => {
            tracing::error!("the token volume does not parse: {e}");
            return;
        }
    };
    spec.volumes.get_or_insert_with(Vec::new).push(volume);
    let mount = VolumeMount {
        name,
        mount_path: TOKEN_MOUNT_PATH.into(),
        read_only: Some(true),
        ..Default::default()
    };
    let init = spec.init_containers.iter_mut().flatten();
    for c in spec.containers.iter_mut().chain(init) {
        if !has(c) {
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(mount.clone());
        }
    }
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// A token shaped like the one TokenRequest returns for the pod: a JWT
/// with the service account's claims, signed by nobody.
pub fn mint_token(
    pod: &Pod,
    now_unix: i64,
    expiration_seconds: i64,
    audience: Option<&str>,
) -> String {
    let meta = &pod.metadata;
    let namespace = meta.namespace.clone().unwrap_or_default();
    let account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".into());
    let header = serde_json::json!({"alg": "none", "kid": "twig-test-kubelet"});
    let claims = serde_json::json!({
        "aud": [audience.unwrap_or("https://kubernetes.default.svc.cluster.local")],
        "exp": now_unix + expiration_seconds,
        "iat": now_unix,
        "nbf": now_unix,
        "iss": "https://kubernetes.default.svc.cluster.local",
        "jti": format!("{:08x}{:08x}", random_u32(), random_u32()),
        "kubernetes.io": {
            "namespace": namespace,
            "pod": {"name": meta.name, "uid": meta.uid},
            "serviceaccount": {"name": account},
        },
        "sub": format!("system:serviceaccount:{namespace}:{account}"),
    });
    let signature: Vec<u8> = (0..8).flat_map(|_| random_u32().to_be_bytes()).collect();
    format!(
        "{}.{}.{}",
        base64url(header.to_string().as_bytes()),
        base64url(claims.to_string().as_bytes()),
        base64url(&signature)
    )
}

fn mode(m: Option<i32>, default: u32) -> u32 {
    m.and_then(|m| u32::try_from(m).ok()).unwrap_or(default)
}

/// Files from `keys` (key → bytes), as kubelet's `MakePayload`: every key
/// without `items`, else each item's key at its path (a missing key fails
/// unless `optional`).
fn key_payload(
    kind: &str,
    keys: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    default_mode: u32,
    optional: bool,
    what: &str,
    payload: &mut Payload,
) -> Result<(), String> {
    match items {
        None | Some([]) => {
            for (k, v) in keys {
                payload.insert(
                    k.clone(),
                    FileProjection {
                        data: v.clone(),
                        mode: default_mode,
                    },
                );
            }
        }
        Some(items) => {
            for item in items {
                let Some(data) = keys.get(&item.key) else {
                    if optional {
                        continue;
                    }
                    return Err(format!(
                        "{what} references non-existent {kind} key: {}",
                        item.key
                    ));
                };
                payload.insert(
                    item.path.clone(),
                    FileProjection {
                        data: data.clone(),
                        mode: mode(item.mode, default_mode),
                    },
                );
            }
        }
    }
    Ok(())
}

fn config_map_keys(cm: &ConfigMap) -> BTreeMap<String, Vec<u8>> {
    let mut keys: BTreeMap<String, Vec<u8>> = cm
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
        .collect();
    keys.extend(
        cm.binary_data
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.0.clone())),
    );
    keys
}

/// A Secret's keys. `stringData` counts too: kube-apiserver folds it into
/// `data` on write, the testkit's API server does not.
fn secret_keys(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    let mut keys: BTreeMap<String, Vec<u8>> = s
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect();
    keys.extend(
        s.string_data
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_bytes().to_vec())),
    );
    keys
}

fn config_map_payload(
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: bool,
    default_mode: u32,
    lookup: &dyn Lookup,
    payload: &mut Payload,
) -> Result<(), String> {
    match lookup.config_map(name) {
        Some(cm) => key_payload(
            "config",
            &config_map_keys(&cm),
            items,
            default_mode,
            optional,
            &format!("configmap {name:?}"),
            payload,
        ),
        None if optional => Ok(()),
        None => Err(format!("configmap {name:?} not found")),
    }
}

fn secret_payload(
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: bool,
    default_mode: u32,
    lookup: &dyn Lookup,
    payload: &mut Payload,
) -> Result<(), String> {
    match lookup.secret(name) {
        Some(s) => key_payload(
            "secret",
            &secret_keys(&s),
            items,
            default_mode,
            optional,
            &format!("secret {name:?}"),
            payload,
        ),
        None if optional => Ok(()),
        None => Err(format!("secret {name:?} not found")),
    }
}

/// `k="v"` lines sorted by key, as kubelet's `fieldpath.FormatMap`.
fn format_map(m: &BTreeMap<String, String>) -> String {
    m.iter()
        .map(|(k, v)| {
            let escaped: String = v
                .chars()
                .flat_map(|c| match c {
                    '"' => vec!['\\', '"'],
                    '\\' => vec!['\\', '\\'],
                    '\n' => vec!['\\', 'n'],
                    '\t' => vec!['\\', 't'],
                    '\r' => vec!['\\', 'r'],
                    c => vec![c],
                })
                .collect();
            format!("{k}=\"{escaped}\"")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The value of a downward API `fieldRef` of a volume.
fn field_value(pod: &Pod, path: &str) -> Result<String, String> {
    let meta = &pod.metadata;
    let subscript = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix("['"))
            .and_then(|r| r.strip_suffix("']"))
            .map(String::from)
    };
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => format_map(meta.labels.as_ref().unwrap_or(&BTreeMap::new())),
        "metadata.annotations" => format_map(meta.annotations.as_ref().unwrap_or(&BTreeMap::new())),
        _ => {
            if let Some(k) = subscript("metadata.labels") {
                meta.labels
                    .as_ref()
                    .and_then(|l| l.get(&k))
                    .cloned()
                    .unwrap_or_default()
            } else if let Some(k) = subscript("metadata.annotations") {
                meta.annotations
                    .as_ref()
                    .and_then(|a| a.get(&k))
                    .cloned()
                    .unwrap_or_default()
            } else {
                return Err(format!(
                    "downward API fieldRef {path:?} is not supported in a volume"
                ));
            }
        }
    })
}

fn downward_payload(
    pod: &Pod,
    items: &[DownwardAPIVolumeFile],
    default_mode: u32,
    payload: &mut Payload,
) -> Result<(), String> {
    for item in items {
        let data = match (&item.field_ref, &item.resource_field_ref) {
            (Some(f), _) => field_value(pod, &f.field_path)?,
            (None, Some(r)) => {
                return Err(format!(
                    "downward API item {:?}: resourceFieldRef {:?} is not supported by the test kubelet",
                    item.path, r.resource
                ))
            }
            (None, None) => return Err(format!("downward API item {:?}: no fieldRef", item.path)),
        };
        payload.insert(
            item.path.clone(),
            FileProjection {
                data: data.into_bytes(),
                mode: mode(item.mode, default_mode),
            },
        );
    }
    Ok(())
}

/// The atomic writer's payload of `volume`, or `None` for a volume that is
/// not written that way; `token` is the pod's current ServiceAccount token.
pub fn payload(
    volume: &Volume,
    pod: &Pod,
    lookup: &dyn Lookup,
    token: &str,
) -> Result<Option<Payload>, String> {
    let mut payload = Payload::new();
    let context = |e: String| format!("volume {:?}: {e}", volume.name);
    if let Some(cm) = &volume.config_map {
        config_map_payload(
            &cm.name,
            cm.items.as_deref(),
            cm.optional == Some(true),
            mode(cm.default_mode, DEFAULT_MODE),
            lookup,
            &mut payload,
        )
        .map_err(context)?;
    } else if let Some(s) = &volume.secret {
        secret_payload(
            s.secret_name.as_deref().unwrap_or_default(),
            s.items.as_deref(),
            s.optional == Some(true),
            mode(s.default_mode, DEFAULT_MODE),
            lookup,
            &mut payload,
        )
        .map_err(context)?;
    } else if let Some(d) = &volume.downward_api {
        downward_payload(
            pod,
            d.items.as_deref().unwrap_or_default(),
            mode(d.default_mode, DEFAULT_MODE),
            &mut payload,
        )
        .map_err(context)?;
    } else if let Some(p) = &volume.projected {
        let default_mode = mode(p.default_mode, DEFAULT_MODE);
        for source in p.sources.iter().flatten() {
            if let Some(ConfigMapProjection {
                name,
                items,
                optional,
            }) = &source.config_map
            {
                config_map_payload(
                    name,
                    items.as_deref(),
                    *optional == Some(true),
                    default_mode,
                    lookup,
                    &mut payload,
                )
                .map_err(context)?;
            } else if let Some(SecretProjection {
                name,
                items,
                optional,
            }) = &source.secret
            {
                secret_payload(
                    name,
                    items.as_deref(),
                    *optional == Some(true),
                    default_mode,
                    lookup,
                    &mut payload,
                )
                .map_err(context)?;
            } else if let Some(d) = &source.downward_api {
                downward_payload(
                    pod,
                    d.items.as_deref().unwrap_or_default(),
                    default_mode,
                    &mut payload,
                )
                .map_err(context)?;
            } else if let Some(t) = &source.service_account_token {
                payload.insert(
                    t.path.clone(),
                    FileProjection {
                        data: token.as_bytes().to_vec(),
                        mode: default_mode,
                    },
                );
            } else {
                return Err(context(
                    "a projected source the test kubelet does not support".into(),
                ));
            }
        }
    } else {
        return Ok(None);
    }
    Ok(Some(payload))
}

/// The plugin directory of a volume kubelet keeps under the pod's
/// `volumes/`, and whether it is memory-backed (tmpfs).
pub fn plugin(volume: &Volume) -> Option<(&'static str, bool)> {
    if volume.config_map.is_some() {
        Some(("kubernetes.io~configmap", false))
    } else if volume.secret.is_some() {
        Some(("kubernetes.io~secret", true))
    } else if volume.projected.is_some() {
        Some(("kubernetes.io~projected", true))
    } else if volume.downward_api.is_some() {
        Some(("kubernetes.io~downward-api", true))
    } else if let Some(e) = &volume.empty_dir {
        Some((
            "kubernetes.io~empty-dir",
            e.medium.as_deref() == Some("Memory"),
        ))
    } else {
        None
    }
}

/// Whether kubelet mounts the volume read-only whatever its mounts say.
pub fn always_read_only(volume: &Volume) -> bool {
    volume.config_map.is_some()
        || volume.secret.is_some()
        || volume.projected.is_some()
        || volume.downward_api.is_some()
}

/// A quantity (`sizeLimit`) in bytes.
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let number: f64 = number.parse().ok()?;
    let factor: f64 = match suffix {
        "" => 1.0,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some((number * factor).ceil() as u64)
}

/// The host side of a pod's volumes.
#[derive(Debug, Default)]
pub struct PodVolumes {
    /// Each volume's directory (or file, for a hostPath) on the host.
    pub paths: HashMap<String, PathBuf>,
    /// What this kubelet mounted, unmounted on teardown (newest last).
    pub mounts: Vec<PathBuf>,
}

/// Why a volume could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The spec asks for what the test kubelet does not do.
    #[error("{0}")]
    Unsupported(String),
    /// A file system call or mount failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VolumeError {
    let path = path.to_path_buf();
    move |source| VolumeError::Io { what, path, source }
}

/// Mounts a tmpfs (of at most `size` bytes) on `dir`.
fn mount_tmpfs(dir: &Path, size: Option<u64>) -> Result<(), VolumeError> {
    let options = size.map(|s| format!("size={s}"));
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        options.as_deref(),
    )
    .map_err(|e| io("mounting a tmpfs on", dir)(e.into()))
}

/// Creates the pod's volume directories (tmpfs mounts when `tmpfs`),
/// returning where each is; the atomic writer fills them later.
pub fn create(pod_dir: &Path, pod: &Pod, tmpfs: bool) -> Result<PodVolumes, VolumeError> {
    let mut out = PodVolumes::default();
    for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        if let Some(h) = &volume.host_path {
            let path = PathBuf::from(&h.path);
            match h.type_.as_deref() {
                Some("DirectoryOrCreate") => {
                    std::fs::create_dir_all(&path).map_err(io("creating", &path))?
                }
                Some("FileOrCreate") if !path.exists() => {
                    std::fs::write(&path, b"").map_err(io("creating", &path))?
                }
                _ => {}
            }
            out.paths.insert(volume.name.clone(), path);
            continue;
        }
        let Some((plugin, memory)) = plugin(volume) else {
            return Err(VolumeError::Unsupported(format!(
                "volume {:?}: only configMap, secret, projected, downwardAPI, emptyDir and hostPath \
                 volumes are supported by the test kubelet",
                volume.name
            )));
        };
        let dir = pod_dir.join("volumes").join(plugin).join(&volume.name);
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        if volume.empty_dir.is_some() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
                .map_err(io("setting the mode of", &dir))?;
        }
        if memory && tmpfs {
            let size = volume
                .empty_dir
                .as_ref()
                .and_then(|e| e.size_limit.as_ref())
                .and_then(|q| quantity_bytes(&q.0));
            mount_tmpfs(&dir, size)?;
            out.mounts.push(dir.clone());
        }
        out.paths.insert(volume.name.clone(), dir);
    }
    Ok(out)
}

/// The CRI mounts of `container` (the `index`th of its kind is irrelevant:
/// the subpath directory is by mount index), binding each `subPath` (as
/// root) under `<pod dir>/volume-subpaths`.
pub fn container_mounts(
    pod_dir: &Path,
    pod: &Pod,
    container: &Container,
    volumes: &mut PodVolumes,
    bind_subpaths: bool,
) -> Result<Vec<api::Mount>, VolumeError> {
    let specs: HashMap<&str, &Volume> = pod
        .spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .map(|v| (v.name.as_str(), v))
        .collect();
    let mut mounts = Vec::new();
    for (index, m) in container.volume_mounts.iter().flatten().enumerate() {
        let unsupported = |why: &str| {
            VolumeError::Unsupported(format!(
                "container {}: volumeMount {:?}: {why}",
                container.name, m.name
            ))
        };
        let (Some(volume), Some(path)) = (
            specs.get(m.name.as_str()),
            volumes.paths.get(&m.name).cloned(),
        ) else {
            return Err(unsupported("no such volume"));
        };
        if m.sub_path_expr.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported(
                "subPathExpr is not supported by the test kubelet",
            ));
        }
        let mut host_path = path.clone();
        if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            if Path::new(sub).is_absolute() || sub.split('/').any(|e| e == "..") {
                return Err(unsupported("subPath must be a relative path without '..'"));
            }
            let wanted = path.join(sub);
            if std::fs::symlink_metadata(&wanted).is_err() {
                std::fs::create_dir_all(&wanted).map_err(io("creating", &wanted))?;
            }
            let resolved = wanted.canonicalize().map_err(io("resolving", &wanted))?;
            let base = path.canonicalize().map_err(io("resolving", &path))?;
            if !resolved.starts_with(&base) {
                return Err(unsupported("subPath resolves outside the volume"));
            }
            host_path = resolved.clone();
            if bind_subpaths {
                let target = pod_dir
                    .join("volume-subpaths")
                    .join(&m.name)
                    .join(&container.name)
                    .join(index.to_string());
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
                }
                if std::fs::symlink_metadata(&target).is_err() {
                    if resolved.is_dir() {
                        std::fs::create_dir(&target).map_err(io("creating", &target))?;
                    } else {
                        std::fs::write(&target, b"").map_err(io("creating", &target))?;
                    }
                    nix::mount::mount(
                        Some(&resolved),
                        &target,
                        None::<&str>,
                        nix::mount::MsFlags::MS_BIND,
                        None::<&str>,
                    )
                    .map_err(|e| io("bind-mounting the subpath on", &target)(e.into()))?;
                    volumes.mounts.push(target.clone());
                }
                host_path = target;
            }
        }
        let propagation = match m.mount_propagation.as_deref() {
            Some("HostToContainer") => api::MountPropagation::PropagationHostToContainer,
            Some("Bidirectional") => api::MountPropagation::PropagationBidirectional,
            _ => api::MountPropagation::PropagationPrivate,
        };
        mounts.push(api::Mount {
            container_path: m.mount_path.clone(),
            host_path: host_path.to_string_lossy().into_owned(),
            readonly: m.read_only == Some(true) || always_read_only(volume),
            propagation: propagation as i32,
            ..Default::default()
        });
    }
    Ok(mounts)
}

/// Unmounts what [`create`] and [`container_mounts`] mounted.
pub fn unmount(volumes: &PodVolumes) {
    for path in volumes.mounts.iter().rev() {
        if let Err(e) = nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!("unmounting {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;

    use super::*;

    struct Objects(HashMap<String, ConfigMap>, HashMap<String, Secret>);

    impl Lookup for Objects {
        fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
            self.0.get(name).cloned().map(Arc::new)
        }
        fn secret(&self, name: &str) -> Option<Arc<Secret>> {
            self.1.get(name).cloned().map(Arc::new)
        }
    }

    fn objects() -> Objects {
        let cm = ConfigMap {
            data: Some(
                [
                    ("a".to_string(), "1".to_string()),
                    ("b".to_string(), "2".to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        };
        let ca = ConfigMap {
            data: Some([("ca.crt".to_string(), "CA".to_string())].into()),
            ..Default::default()
        };
        let secret = Secret {
            data: Some([("password".to_string(), ByteString(b"hunter2".to_vec()))].into()),
            ..Default::default()
        };
        Objects(
            [
                ("conf".to_string(), cm),
                (ROOT_CA_CONFIG_MAP.to_string(), ca),
            ]
            .into(),
            [("creds".to_string(), secret)].into(),
        )
    }

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "team", "uid": "u-1",
                         "labels": {"app": "web", "tier": "front"}},
            "spec": spec,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn files(p: &Payload) -> Vec<(String, String, u32)> {
        p.iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    String::from_utf8_lossy(&v.data).into_owned(),
                    v.mode,
                )
            })
            .collect()
    }

    fn strs(v: &[(&str, &str, u32)]) -> Vec<(String, String, u32)> {
        v.iter()
            .map(|(a, b, m)| (a.to_string(), b.to_string(), *m))
            .collect()
    }

    fn volume(v: serde_json::Value) -> Volume {
        serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn config_map_and_secret_payloads_follow_items_modes_and_optional() {
        let p = pod(serde_json::json!({"containers": []}));
        let o = objects();
        let all = volume(serde_json::json!({"name": "c", "configMap": {"name": "conf"}}));
        let got = payload(&all, &p, &o, "").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            files(&got.unwrap_or_default()),
            strs(&[("a", "1", 0o644), ("b", "2", 0o644)])
        );
        let items = volume(
            serde_json::json!({"name": "c", "configMap": {"name": "conf", "defaultMode": 0o600,
            "items": [{"key": "a", "path": "dir/a.txt"}, {"key": "b", "path": "b", "mode": 0o400}]}}),
        );
        let got = payload(&items, &p, &o, "").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            files(&got.unwrap_or_default()),
            strs(&[("b", "2", 0o400), ("dir/a.txt", "1", 0o600)])
        );
        let missing_key = volume(
            serde_json::json!({"name": "c", "configMap": {"name": "conf",
            "items": [{"key": "zz", "path": "zz"}]}}),
        );
        let err = payload(&missing_key, &p, &o, "").err().unwrap_or_default();
        assert!(err.contains("non-existent config key: zz"), "{err}");
        let missing = volume(serde_json::json!({"name": "c", "configMap": {"name": "nope"}}));
        assert!(payload(&missing, &p, &o, "").is_err());
        let optional = volume(
            serde_json::json!({"name": "c", "configMap": {"name": "nope", "optional": true}}),
        );
        assert_eq!(
            payload(&optional, &p, &o, "").ok(),
            Some(Some(Payload::new()))
        );
        let secret = volume(serde_json::json!({"name": "s", "secret": {"secretName": "creds"}}));
        let got = payload(&secret, &p, &o, "").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            files(&got.unwrap_or_default()),
            strs(&[("password", "hunter2", 0o644)])
        );
        let empty = volume(serde_json::json!({"name": "e", "emptyDir": {}}));
        assert_eq!(payload(&empty, &p, &o, "").ok(), Some(None));
    }

    #[test]
    fn the_token_volume_is_injected_as_the_admission_plugin_does_and_projects_three_files() {
        let mut p = pod(serde_json::json!({
            "containers": [{"name": "app"}, {"name": "own", "volumeMounts": [
                {"name": "x", "mountPath": TOKEN_MOUNT_PATH}]}],
            "initContainers": [{"name": "init"}],
        }));
        inject_service_account_volume(&mut p, None);
        let spec = p.spec.clone().unwrap_or_default();
        assert_eq!(spec.service_account_name.as_deref(), Some("default"));
        let vols = spec.volumes.clone().unwrap_or_default();
        assert_eq!(vols.len(), 1);
        let name = &vols[0].name;
        assert!(
            name.starts_with(TOKEN_VOLUME_PREFIX) && name.len() == TOKEN_VOLUME_PREFIX.len() + 5,
            "{name}"
        );
        let mounted = |c: &Container| {
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| &m.name == name && m.read_only == Some(true))
        };
        assert!(mounted(&spec.containers[0]) && !mounted(&spec.containers[1]));
        assert!(spec.init_containers.iter().flatten().all(mounted));
        let token = mint_token(&p, 1_000, 3607, None);
        let got = payload(&vols[0], &p, &objects(), &token).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            files(&got.unwrap_or_default()),
            strs(&[
                ("ca.crt", "CA", 0o644),
                ("namespace", "team", 0o644),
                ("token", &token, 0o644)
            ])
        );
        assert_eq!(token.split('.').count(), 3);
        // Injected once; a pod that opts out (or whose account does) gets none.
        inject_service_account_volume(&mut p, None);
        assert_eq!(p.spec.and_then(|s| s.volumes).map(|v| v.len()), Some(1));
        let mut out = pod(
            serde_json::json!({"containers": [{"name": "app"}], "automountServiceAccountToken": false}),
        );
        inject_service_account_volume(&mut out, Some(true));
        assert!(out.spec.and_then(|s| s.volumes).is_none());
        let mut account_out = pod(serde_json::json!({"containers": [{"name": "app"}]}));
        inject_service_account_volume(&mut account_out, Some(false));
        assert!(account_out.spec.and_then(|s| s.volumes).is_none());
    }

    #[test]
    fn downward_api_files_are_kubelets() {
        let p = pod(serde_json::json!({"containers": []}));
        let v = volume(serde_json::json!({"name": "d", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "app", "fieldRef": {"fieldPath": "metadata.labels['app']"}},
            {"path": "uid", "fieldRef": {"fieldPath": "metadata.uid"}, "mode": 0o400},
        ]}}));
        let got = payload(&v, &p, &objects(), "").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            files(&got.unwrap_or_default()),
            strs(&[
                ("app", "web", 0o644),
                ("labels", "app=\"web\"\ntier=\"front\"", 0o644),
                ("uid", "u-1", 0o400)
            ])
        );
    }

    #[test]
    fn mounts_are_read_only_for_configuration_volumes_and_subpaths_resolve_inside() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = pod(serde_json::json!({
            "volumes": [{"name": "c", "configMap": {"name": "conf"}}, {"name": "scratch", "emptyDir": {}}],
            "containers": [{"name": "app", "volumeMounts": [
                {"name": "c", "mountPath": "/etc/conf"},
                {"name": "scratch", "mountPath": "/data", "mountPropagation": "HostToContainer"},
                {"name": "scratch", "mountPath": "/logs", "subPath": "logs", "readOnly": true},
            ]}],
        }));
        let mut vols = create(dir.path(), &p, false).unwrap_or_else(|e| panic!("{e}"));
        let c = &p.spec.clone().unwrap_or_default().containers[0];
        let mounts =
            container_mounts(dir.path(), &p, c, &mut vols, false).unwrap_or_else(|e| panic!("{e}"));
        let scratch = dir.path().join("volumes/kubernetes.io~empty-dir/scratch");
        let summary: Vec<(String, String, bool, i32)> = mounts
            .into_iter()
            .map(|m| (m.container_path, m.host_path, m.readonly, m.propagation))
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "/etc/conf".into(),
                    dir.path()
                        .join("volumes/kubernetes.io~configmap/c")
                        .to_string_lossy()
                        .into_owned(),
                    true,
                    api::MountPropagation::PropagationPrivate as i32
                ),
                (
                    "/data".into(),
                    scratch.to_string_lossy().into_owned(),
                    false,
                    api::MountPropagation::PropagationHostToContainer as i32
                ),
                (
                    "/logs".into(),
                    scratch
                        .canonicalize()
                        .unwrap_or_default()
                        .join("logs")
                        .to_string_lossy()
                        .into_owned(),
                    true,
                    api::MountPropagation::PropagationPrivate as i32
                ),
            ]
        );
        assert!(
            scratch.join("logs").is_dir(),
            "a missing subPath is created"
        );
        std::os::unix::fs::symlink("/etc", scratch.join("escape"))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut bad = c.clone();
        bad.volume_mounts = Some(vec![VolumeMount {
            name: "scratch".into(),
            mount_path: "/x".into(),
            sub_path: Some("escape".into()),
            ..Default::default()
        }]);
        let err = container_mounts(dir.path(), &p, &bad, &mut vols, false).err();
        assert!(err.is_some_and(|e| e.to_string().contains("outside the volume")));
    }

    #[test]
    fn quantities_are_bytes() {
        assert_eq!(quantity_bytes("64Mi"), Some(64 << 20));
        assert_eq!(quantity_bytes("1G"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1.5Ki"), Some(1536));
        assert_eq!(quantity_bytes("12"), Some(12));
        assert_eq!(quantity_bytes("1x"), None);
    }
}
