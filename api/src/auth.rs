//! Who is calling: API keys mapped to namespaces (tenants), and the
//! per-sandbox access tokens, derived rather than stored so that twig-api
//! keeps no state of its own.

use std::collections::BTreeMap;
use std::path::Path;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::{digest, hmac};
use serde::Deserialize;

/// A key file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not the expected YAML.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// The API key file: each tenant's namespace and the SHA-256 digests of its keys.
///
/// ```yaml
/// tenants:
///   - namespace: team-a
///     keySha256: [9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
/// ```
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeyFile {
    tenants: Vec<TenantEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TenantEntry {
    namespace: String,
    key_sha256: Vec<String>,
}

/// The tenants twig-api serves, by the digest of their keys.
#[derive(Clone, Debug, Default)]
pub struct Tenants {
    by_digest: BTreeMap<[u8; 32], String>,
}

impl Tenants {
    /// Reads the key file at `path`.
    pub fn load(path: &Path) -> Result<Self, KeysError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| KeysError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text).map_err(|message| KeysError::Invalid {
            path: shown,
            message,
        })
    }

    /// Parses a key file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: KeyFile = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        let mut tenants = Self::default();
        for tenant in file.tenants {
            if !is_dns_label(&tenant.namespace) {
                return Err(format!(
                    "namespace {:?} is not a Kubernetes namespace name",
                    tenant.namespace
                ));
            }
            for hex in &tenant.key_sha256 {
                let digest = parse_digest(hex)
                    .ok_or_else(|| format!("keySha256 {hex:?} is not 64 hex digits"))?;
                if let Some(other) = tenants.by_digest.insert(digest, tenant.namespace.clone()) {
                    return Err(format!(
                        "one key is given to both {other} and {}",
                        tenant.namespace
                    ));
                }
            }
        }
        Ok(tenants)
    }

    /// Adds a tenant's key (tests, and keys given on the command line).
    pub fn insert(&mut self, key: &str, namespace: &str) {
        self.by_digest.insert(sha256(key), namespace.to_string());
    }

    /// The namespace of `key`, if it is a tenant's.
    pub fn namespace_of(&self, key: &str) -> Option<&str> {
        let wanted = sha256(key);
        // Compare every digest in constant time, not just the first match.
        let mut found = None;
        for (digest, ns) in &self.by_digest {
            if same_bytes(digest, &wanted) {
                found = Some(ns.as_str());
            }
        }
        found
    }

    /// Every tenant namespace.
    pub fn namespaces(&self) -> Vec<String> {
        let mut all: Vec<String> = self.by_digest.values().cloned().collect();
        all.sort();
        all.dedup();
        all
    }
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The SHA-256 of `s` in hex: what a pod's
/// `twig.dev/envd-token-sha256` holds of its envd token.
pub fn sha256_hex(s: &str) -> String {
    sha256(s).iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(key: &str) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(digest::digest(&digest::SHA256, key.as_bytes()).as_ref());
    out
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Whether `name` is a DNS-1123 label (a namespace's or a sandbox's name).
pub fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// What a token lets its holder reach.
#[derive(Clone, Copy)]
pub enum TokenKind {
    /// The sandbox's envd (port 49983): commands and files.
    Envd,
    /// The sandbox's other ports, when its traffic is not public.
    Traffic,
}

/// Derives per-sandbox tokens from one secret: the same on every replica,
/// different for every tenant and sandbox.
#[derive(Clone)]
pub struct TokenKey(hmac::Key);

impl TokenKey {
    /// A key from secret bytes (at least 32).
    pub fn new(secret: &[u8]) -> Result<Self, String> {
        if secret.len() < 32 {
            return Err(format!(
                "the token secret has {} bytes; at least 32 are needed",
                secret.len()
            ));
        }
        Ok(Self(hmac::Key::new(hmac::HMAC_SHA256, secret)))
    }

    /// The token of `kind` for sandbox `id` of namespace `ns`.
    pub fn token(&self, kind: TokenKind, ns: &str, id: &str) -> String {
        let what = match kind {
            TokenKind::Envd => "envd",
            TokenKind::Traffic => "traffic",
        };
        let tag = hmac::sign(&self.0, format!("{what}\0{ns}\0{id}").as_bytes());
        URL_SAFE_NO_PAD.encode(&tag.as_ref()[..24])
    }

    /// Whether `given` is the token of `kind` for the sandbox (constant time).
    pub fn check(&self, kind: TokenKind, ns: &str, id: &str, given: &str) -> bool {
        let want = self.token(kind, ns, id);
        same_bytes(want.as_bytes(), given.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_their_tenant_only() {
        let file = "tenants:\n  - namespace: team-a\n    keySha256: [9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]\n";
        let tenants = Tenants::parse(file).expect("parse");
        assert_eq!(tenants.namespace_of("test"), Some("team-a"));
        assert_eq!(tenants.namespace_of("test2"), None);
        assert_eq!(tenants.namespace_of(""), None);
    }

    #[test]
    fn bad_key_files_are_refused_with_the_reason() {
        let short = "tenants:\n  - namespace: a\n    keySha256: [abc]\n";
        assert!(Tenants::parse(short).unwrap_err().contains("64 hex"));
        let ns = "tenants:\n  - namespace: Team_A\n    keySha256: []\n";
        assert!(Tenants::parse(ns).unwrap_err().contains("namespace"));
        let twice = format!(
            "tenants:\n  - namespace: a\n    keySha256: [{0}]\n  - namespace: b\n    keySha256: [{0}]\n",
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
        assert!(Tenants::parse(&twice).unwrap_err().contains("both"));
        assert!(Tenants::parse("tenants: 3").is_err());
    }

    #[test]
    fn tokens_differ_per_tenant_sandbox_and_kind() {
        let key = TokenKey::new(&[7; 32]).expect("key");
        let a = key.token(TokenKind::Envd, "a", "sbx");
        assert!(key.check(TokenKind::Envd, "a", "sbx", &a));
        assert!(!key.check(TokenKind::Envd, "b", "sbx", &a));
        assert!(!key.check(TokenKind::Envd, "a", "sby", &a));
        assert!(!key.check(TokenKind::Traffic, "a", "sbx", &a));
        assert!(!key.check(TokenKind::Envd, "a", "sbx", ""));
        assert!(TokenKey::new(&[1; 8]).is_err());
    }
}
