//! Artifact references: `registry/repository[:tag][@sha256:<hex>]`, as the
//! distribution spec names them (the registry host always explicit).

use std::fmt;

use crate::error::{Error, Result};

/// A parsed reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]`.
    pub registry: String,
    /// `a/b/c`: lower-case path components.
    pub repository: String,
    /// The tag, if any.
    pub tag: Option<String>,
    /// `sha256:<64 hex>`, if any.
    pub digest: Option<String>,
}

impl Reference {
    /// Parses `host[:port]/repo/path[:tag][@sha256:hex]`; at least a tag or
    /// a digest. The registry host must be explicit (no Docker Hub default).
    pub fn parse(s: &str) -> Result<Reference> {
        let bad = |why: &str| Error::Invalid(format!("artifact reference {s:?}: {why}"));
        if s.len() > 512 {
            return Err(bad("longer than 512 characters"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                check_digest(d).map_err(|_| bad("the digest is not sha256:<64 hex>"))?;
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (registry, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("no registry host (host[:port]/repository)"))?;
        if !(registry.contains('.') || registry.contains(':') || registry == "localhost")
            || !registry
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
        {
            return Err(bad("the registry host is not a host[:port]"));
        }
        let (repository, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, Some(t)),
            _ => (path, None),
        };
        if repository.is_empty()
            || repository.split('/').any(|c| {
                c.is_empty()
                    || !c.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    })
                    || !c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
                    || !c.ends_with(|ch: char| ch.is_ascii_alphanumeric())
            })
        {
            return Err(bad(
                "the repository is not lower-case path components of [a-z0-9._-]",
            ));
        }
        if let Some(t) = tag {
            let ok = !t.is_empty()
                && t.len() <= 128
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                && !t.starts_with(['.', '-']);
            if !ok {
                return Err(bad("the tag is not [A-Za-z0-9_][A-Za-z0-9._-]{0,127}"));
            }
        }
        if tag.is_none() && digest.is_none() {
            return Err(bad("neither a tag nor a digest"));
        }
        Ok(Reference {
            registry: registry.to_string(),
            repository: repository.to_string(),
            tag: tag.map(str::to_string),
            digest,
        })
    }

    /// What to ask the registry for: the digest if there is one, else the tag.
    pub fn target(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or_default()
    }

    /// The same repository, at `digest`.
    pub fn at(&self, digest: &str) -> Reference {
        Reference {
            digest: Some(digest.to_string()),
            ..self.clone()
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// Checks `sha256:<64 lower-case hex>`.
pub fn check_digest(d: &str) -> Result<()> {
    match d.strip_prefix("sha256:") {
        Some(h)
            if h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(())
        }
        _ => Err(Error::Corrupt(format!("{d:?} is not a sha256 digest"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_and_print_back() {
        let d = format!("sha256:{}", "a".repeat(64));
        for s in [
            "127.0.0.1:5000/twig/team-a/snap:v1".to_string(),
            format!("registry.example.com/twig/x@{d}"),
            format!("localhost/a/b:t@{d}"),
        ] {
            assert_eq!(Reference::parse(&s).unwrap().to_string(), s);
        }
        let r = Reference::parse("r.io:443/a/b:t").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.target()),
            ("r.io:443", "a/b", "t")
        );
        assert_eq!(r.at(&d).target(), d);
    }

    #[test]
    fn malformed_references_are_refused() {
        for s in [
            "twig/snap:v1",        // no host
            "r.io/Upper:v1",       // upper case
            "r.io/a//b:v1",        // empty component
            "r.io/a/b",            // neither tag nor digest
            "r.io/a/b:-x",         // bad tag
            "r.io/a/b@sha256:abc", // short digest
            "r.io/a/b@md5:0123",   // other algorithm
            "r.io/../b:v1",        // dot component
        ] {
            assert!(Reference::parse(s).is_err(), "{s} accepted");
        }
    }
}
