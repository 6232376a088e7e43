//! A SandboxTemplate's image pull credentials, as kubelet finds a pod's: the
//! `imagePullSecrets` of the template namespace's `default` ServiceAccount
//! (a SandboxTemplate names no ServiceAccount, so its build runs as a pod
//! without `serviceAccountName` would), each a `kubernetes.io/dockerconfigjson`
//! (`.dockerconfigjson`: `{"auths": {registry: login}}`) or
//! `kubernetes.io/dockercfg` (`.dockercfg`: `{registry: login}`) Secret; other
//! types, missing Secrets and unparsable ones are skipped (with a warning
//! naming the Secret, never its content), as kubelet skips them.
//!
//! A login is kept for an image when its registry key matches the image's
//! registry as kubelet's credential keyring matches (`pkg/credentialprovider`):
//! the same host (case-insensitive, port included; `docker.io` and
//! `index.docker.io` are one host, and an image without a registry is on
//! it), and a key with a path (`registry.example.com/team-a`) only for the
//! images under that path. Unlike kubelet, no `*` wildcards in keys. The
//! more specific keys come first, then the order of the Secrets.
//!
//! A login is a secret: [`RegistryCredential`]'s `Debug` shows the registry
//! and the user only, and nothing here logs one.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::{Api, Client};
use serde::Deserialize;

use crate::context::is_not_found;

/// The ServiceAccount whose `imagePullSecrets` a template's build uses.
pub const SERVICE_ACCOUNT: &str = "default";

/// `type` of a Secret holding a `.dockerconfigjson`.
pub const DOCKER_CONFIG_JSON: &str = "kubernetes.io/dockerconfigjson";
/// `type` of a Secret holding a (legacy) `.dockercfg`.
pub const DOCKERCFG: &str = "kubernetes.io/dockercfg";

/// One registry login, as CRI's `AuthConfig` carries it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RegistryCredential {
    /// The registry host of its key (`registry.example.com:5000`, `docker.io`).
    pub server: String,
    /// The user name.
    pub username: String,
    /// The password.
    pub password: String,
    /// base64 of `username:password` (the docker config's `auth`).
    pub auth: String,
    /// A token for the registry's identity provider (`identitytoken`).
    pub identity_token: String,
    /// A bearer token for the registry (`registrytoken`).
    pub registry_token: String,
}

impl std::fmt::Debug for RegistryCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCredential")
            .field("server", &self.server)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// A docker config's key: a registry host and an optional path under it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    host: String,
    path: String,
}

/// `docker.io`'s aliases, as kubelet's keyring treats them.
fn normalize_host(host: &str) -> String {
    let host = host.to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" => "docker.io".to_string(),
        _ => host,
    }
}

/// A docker config key (`https://index.docker.io/v1/`,
/// `registry.example.com:5000`, `registry.example.com/team-a`).
fn parse_key(key: &str) -> Option<Key> {
    let bare = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let (host, path) = bare.split_once('/').unwrap_or((bare, ""));
    if host.is_empty() {
        return None;
    }
    let host = normalize_host(host);
    let mut path = path.trim_matches('/').to_string();
    // The legacy Docker Hub key `https://index.docker.io/v1/` is the host.
    if host == "docker.io" && (path == "v1" || path == "v2") {
        path.clear();
    }
    Some(Key { host, path })
}

/// The registry host and the repository path of `image`
/// (`python:3` → `docker.io`, `library/python`).
pub fn image_registry(image: &str) -> (String, String) {
    let name = image.split('@').next().unwrap_or(image);
    // A tag follows the last `:` after the last `/`.
    let name = match (name.rfind(':'), name.rfind('/')) {
        (Some(colon), slash) if slash.is_none_or(|s| colon > s) => &name[..colon],
        _ => name,
    };
    match name.split_once('/') {
        Some((first, rest))
            if first.contains('.') || first.contains(':') || first == "localhost" =>
        {
            (normalize_host(first), rest.to_string())
        }
        Some(_) => ("docker.io".to_string(), name.to_string()),
        None => ("docker.io".to_string(), format!("library/{name}")),
    }
}

fn key_matches(key: &Key, host: &str, path: &str) -> bool {
    key.host == host
        && (key.path.is_empty()
            || path == key.path
            || path
                .strip_prefix(key.path.as_str())
                .is_some_and(|rest| rest.starts_with('/')))
}

/// One login of a docker config.
#[derive(Deserialize, Default)]
struct Entry {
    #[serde(default)]
    username: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    auth: String,
    #[serde(default)]
    identitytoken: String,
    #[serde(default)]
    registrytoken: String,
}

#[derive(Deserialize)]
struct DockerConfigJson {
    #[serde(default)]
    auths: BTreeMap<String, Entry>,
}

/// The logins of one pull Secret, each with its key; `Err` says why the
/// Secret is not a docker config (never quoting its content).
fn logins(secret: &Secret) -> Result<Vec<(Key, RegistryCredential)>, String> {
    let data = secret.data.as_ref();
    let field = |name: &str| data.and_then(|d| d.get(name)).map(|b| b.0.as_slice());
    let entries: BTreeMap<String, Entry> = match secret.type_.as_deref() {
        Some(DOCKER_CONFIG_JSON) => {
            let bytes =
                field(".dockerconfigjson").ok_or("it has no .dockerconfigjson".to_string())?;
            serde_json::from_slice::<DockerConfigJson>(bytes)
                .map_err(|e| {
                    format!(
                        "its .dockerconfigjson does not parse (at line {}, column {})",
                        e.line(),
                        e.column()
                    )
                })?
                .auths
        }
        Some(DOCKERCFG) => {
            let bytes = field(".dockercfg").ok_or("it has no .dockercfg".to_string())?;
            serde_json::from_slice(bytes).map_err(|e| {
                format!(
                    "its .dockercfg does not parse (at line {}, column {})",
                    e.line(),
                    e.column()
                )
            })?
        }
        other => {
            return Err(format!(
                "its type is {:?}, not {DOCKER_CONFIG_JSON} or {DOCKERCFG}",
                other.unwrap_or_default()
            ))
        }
    };
    Ok(entries
        .into_iter()
        .filter_map(|(k, e)| {
            let key = parse_key(&k)?;
            let credential = RegistryCredential {
                server: key.host.clone(),
                username: e.username,
                password: e.password,
                auth: e.auth,
                identity_token: e.identitytoken,
                registry_token: e.registrytoken,
            };
            Some((key, credential))
        })
        .collect())
}

/// The logins of `secrets` (in order) for `image`: the most specific keys
/// first, then in the Secrets' order; each login once.
pub fn for_image(secrets: &[Secret], image: &str) -> Vec<RegistryCredential> {
    let (host, path) = image_registry(image);
    let mut found: Vec<(usize, RegistryCredential)> = Vec::new();
    for secret in secrets {
        let name = secret.metadata.name.as_deref().unwrap_or_default();
        match logins(secret) {
            Ok(logins) => {
                for (key, credential) in logins {
                    if key_matches(&key, &host, &path)
                        && !found.iter().any(|(_, c)| *c == credential)
                    {
                        found.push((key.path.len(), credential));
                    }
                }
            }
            Err(why) => tracing::warn!(secret = name, "skipping an image pull secret: {why}"),
        }
    }
    // Stable: equally specific keys keep the Secrets' order.
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found.into_iter().map(|(_, c)| c).collect()
}

/// The logins for `image` of the pull secrets of `namespace`'s `default`
/// ServiceAccount (none when it or they are missing).
pub async fn resolve(
    client: &Client,
    namespace: &str,
    image: &str,
) -> Result<Vec<RegistryCredential>, kube::Error> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let account = match accounts.get(SERVICE_ACCOUNT).await {
        Ok(a) => a,
        Err(e) if is_not_found(&e) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let names: Vec<String> = account
        .image_pull_secrets
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.name)
        .filter(|n| !n.is_empty())
        .collect();
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut secrets = Vec::with_capacity(names.len());
    for name in &names {
        match api.get(name).await {
            Ok(s) => secrets.push(s),
            Err(e) if is_not_found(&e) => tracing::warn!(
                namespace,
                secret = name,
                "the image pull secret of ServiceAccount {SERVICE_ACCOUNT} does not exist"
            ),
            Err(e) => return Err(e),
        }
    }
    Ok(for_image(&secrets, image))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use kube::api::ObjectMeta;

    fn secret(name: &str, type_: &str, field: &str, json: serde_json::Value) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            type_: Some(type_.into()),
            data: Some([(field.to_string(), ByteString(json.to_string().into_bytes()))].into()),
            ..Default::default()
        }
    }

    fn config_json(auths: serde_json::Value) -> Secret {
        secret(
            "regcred",
            DOCKER_CONFIG_JSON,
            ".dockerconfigjson",
            serde_json::json!({ "auths": auths }),
        )
    }

    fn users(found: &[RegistryCredential]) -> Vec<&str> {
        found.iter().map(|c| c.username.as_str()).collect()
    }

    #[test]
    fn an_image_names_its_registry_and_repository() {
        for (image, host, path) in [
            ("python:3", "docker.io", "library/python"),
            ("library/python", "docker.io", "library/python"),
            ("bitnami/redis:7", "docker.io", "bitnami/redis"),
            ("docker.io/bitnami/redis", "docker.io", "bitnami/redis"),
            (
                "index.docker.io/bitnami/redis",
                "docker.io",
                "bitnami/redis",
            ),
            (
                "reg.example:5000/team-a/app:1",
                "reg.example:5000",
                "team-a/app",
            ),
            ("Reg.Example/app@sha256:abc", "reg.example", "app"),
            ("localhost/app:dev", "localhost", "app"),
            ("localhost:5000/app", "localhost:5000", "app"),
        ] {
            assert_eq!(
                image_registry(image),
                (host.to_string(), path.to_string()),
                "{image}"
            );
        }
    }

    #[test]
    fn logins_match_the_images_registry_as_kubelets_keyring_does() {
        let s = config_json(serde_json::json!({
            "https://index.docker.io/v1/": {"username": "hub", "password": "p1"},
            "reg.example:5000": {"username": "port", "password": "p2"},
            "reg.example": {"username": "plain", "auth": "cGxhaW46cDM="},
            "reg.example/team-a": {"username": "team-a", "password": "p4"},
            "https://other.example/": {"identitytoken": "t5"},
        }));
        let find = |image: &str| for_image(std::slice::from_ref(&s), image);
        assert_eq!(users(&find("python:3")), ["hub"]);
        assert_eq!(users(&find("docker.io/bitnami/redis")), ["hub"]);
        assert_eq!(users(&find("index.docker.io/library/python")), ["hub"]);
        // The port is part of the host.
        assert_eq!(users(&find("reg.example:5000/x")), ["port"]);
        // A key with a path: only under it, and before the host's own.
        assert_eq!(
            users(&find("reg.example/team-a/app:1")),
            ["team-a", "plain"]
        );
        assert_eq!(users(&find("reg.example/team-ab/app")), ["plain"]);
        assert_eq!(users(&find("reg.example/app")), ["plain"]);
        assert!(find("evil.example/reg.example/app").is_empty());
        assert!(find("reg.example.evil/app").is_empty());
        let other = find("other.example/app");
        assert_eq!(other.len(), 1);
        assert_eq!(
            (other[0].server.as_str(), other[0].identity_token.as_str()),
            ("other.example", "t5")
        );
        let plain = &find("reg.example/app")[0];
        assert_eq!(
            (plain.server.as_str(), plain.auth.as_str()),
            ("reg.example", "cGxhaW46cDM=")
        );
    }

    #[test]
    fn both_docker_secret_types_are_read_and_others_skipped() {
        let legacy = secret(
            "old",
            DOCKERCFG,
            ".dockercfg",
            serde_json::json!({"docker.io": {"username": "legacy", "password": "p"}}),
        );
        let opaque = secret(
            "opaque",
            "Opaque",
            ".dockerconfigjson",
            serde_json::json!({"auths": {"docker.io": {"username": "opaque"}}}),
        );
        let broken = Secret {
            data: Some(
                [(
                    ".dockerconfigjson".to_string(),
                    ByteString(b"{not json: hunter2".to_vec()),
                )]
                .into(),
            ),
            ..config_json(serde_json::json!({}))
        };
        let json = config_json(serde_json::json!({"docker.io": {"username": "new"}}));
        let found = for_image(&[opaque, broken.clone(), legacy, json], "python");
        assert_eq!(users(&found), ["legacy", "new"]);
        let why = logins(&broken).expect_err("broken");
        assert!(!why.contains("hunter2"), "{why}");
    }

    #[test]
    fn a_login_shows_no_secret() {
        let c = RegistryCredential {
            server: "reg.example".into(),
            username: "alice".into(),
            password: "hunter2".into(),
            auth: "YWxpY2U6aHVudGVyMg==".into(),
            identity_token: "tok-1".into(),
            registry_token: "tok-2".into(),
        };
        let shown = format!("{c:?}");
        assert!(
            shown.contains("alice") && shown.contains("reg.example"),
            "{shown}"
        );
        for secret in ["hunter2", "YWxp", "tok-1", "tok-2"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }
}
