//! A client of the OCI distribution API: manifests and blobs by digest,
//! chunked uploads, and the registry's authentication (anonymous, Basic,
//! or a Bearer token from its token service, with `auths` credentials of a
//! Docker `config.json`, the format of `kubernetes.io/dockerconfigjson`
//! Secrets).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::header::{
    ACCEPT, AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LOCATION, RANGE,
    WWW_AUTHENTICATE,
};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::reference::{check_digest, Reference};

/// The media type of the manifests this crate writes and reads.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Largest manifest accepted.
const MAX_MANIFEST: usize = 4 << 20;
/// How long the registry may take to answer a request's headers.
const ANSWER: Duration = Duration::from_secs(30);
/// How long a body may stall between two of its frames.
pub(crate) const STALL: Duration = Duration::from_secs(60);

/// Registry credentials by host (`auths` of a Docker `config.json`).
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    by_host: BTreeMap<String, (String, String)>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

impl Credentials {
    /// Parses a Docker `config.json` (`{"auths": {"host": {"auth":
    /// base64(user:password)} | {"username", "password"}}}`). Keys may be
    /// URLs (`https://host/v1/`): their host is used.
    pub fn from_docker_config(bytes: &[u8]) -> Result<Credentials> {
        let c: DockerConfig = serde_json::from_slice(bytes).map_err(|e| {
            Error::Invalid(format!(
                "registry credentials: not a Docker config.json: {e}"
            ))
        })?;
        let mut by_host = BTreeMap::new();
        for (key, a) in c.auths {
            let host = key
                .trim_start_matches("https://")
                .trim_start_matches("http://")
                .split('/')
                .next()
                .unwrap_or_default()
                .to_string();
            let pair = match (a.auth, a.username, a.password) {
                (Some(auth), _, _) => {
                    let raw = base64::engine::general_purpose::STANDARD
                        .decode(auth.trim())
                        .map_err(|e| {
                            Error::Invalid(format!(
                                "registry credentials for {host}: auth is not base64: {e}"
                            ))
                        })?;
                    let s = String::from_utf8(raw).map_err(|_| {
                        Error::Invalid(format!(
                            "registry credentials for {host}: auth is not UTF-8"
                        ))
                    })?;
                    let (u, p) = s.split_once(':').ok_or_else(|| {
                        Error::Invalid(format!(
                            "registry credentials for {host}: auth is not user:password"
                        ))
                    })?;
                    (u.to_string(), p.to_string())
                }
                (None, Some(u), Some(p)) => (u, p),
                _ => {
                    return Err(Error::Invalid(format!(
                        "registry credentials for {host}: neither auth nor username and password"
                    )))
                }
            };
            by_host.insert(host, pair);
        }
        Ok(Credentials { by_host })
    }

    /// Reads a Docker `config.json` file.
    pub fn load(path: &Path) -> Result<Credentials> {
        let bytes =
            std::fs::read(path).map_err(Error::local("reading the registry credentials"))?;
        Credentials::from_docker_config(&bytes)
    }

    fn of(&self, host: &str) -> Option<&(String, String)> {
        self.by_host.get(host)
    }
}

/// A registry client. One per node; it keeps tokens by registry and scope.
/// Clones share its connections and tokens.
#[derive(Clone)]
pub struct Client {
    http: hyper_util::client::legacy::Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    creds: Credentials,
    plain_http: Vec<String>,
    tokens: Arc<Mutex<HashMap<(String, String), String>>>,
}

/// What a request needs of the repository: the token's scope.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Pull,
    Push,
}

impl Client {
    /// A client using `creds`, speaking plain HTTP to the registries in
    /// `plain_http` (`host:port`, e.g. a registry on loopback) and HTTPS,
    /// verified against the system's roots, to all others (none: every
    /// HTTPS registry is refused, said once at start).
    pub fn new(creds: Credentials, plain_http: Vec<String>) -> Result<Client> {
        let builder = match hyper_rustls::HttpsConnectorBuilder::new().with_native_roots() {
            Ok(b) => b,
            // A node image without CA certificates still serves plain-HTTP
            // registries; an HTTPS one is then refused (unknown issuer).
            Err(e) => {
                tracing::warn!(error = %e, "no system CA certificates: HTTPS registries will be refused");
                let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| Error::Invalid(format!("TLS configuration: {e}")))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth();
                hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls)
            }
        };
        let https = builder.https_or_http().enable_http1().build();
        let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(https);
        Ok(Client {
            http,
            creds,
            plain_http,
            tokens: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    fn base(&self, r: &Reference) -> String {
        let scheme = if self.plain_http.contains(&r.registry) {
            "http"
        } else {
            "https"
        };
        format!("{scheme}://{}/v2/{}", r.registry, r.repository)
    }

    /// The manifest `target` (tag or digest) of `r`'s repository and its
    /// digest, checked against `target` when that is a digest.
    pub async fn manifest(&self, r: &Reference, target: &str) -> Result<(Vec<u8>, String)> {
        let url = format!("{}/manifests/{target}", self.base(r));
        let resp = self
            .send(
                r,
                Access::Pull,
                Method::GET,
                &url,
                &[(ACCEPT, OCI_MANIFEST)],
                Bytes::new(),
            )
            .await?;
        let resp = expect(resp, &[StatusCode::OK], &format!("manifest {r}")).await?;
        let body = read_limited(resp.into_body(), MAX_MANIFEST, "a manifest").await?;
        let digest = digest_of(&body);
        if target.starts_with("sha256:") && digest != target {
            return Err(Error::Corrupt(format!(
                "manifest {target} of {}/{} arrived with digest {digest}",
                r.registry, r.repository
            )));
        }
        Ok((body, digest))
    }

    /// Whether the repository has the manifest `digest`.
    pub async fn has_manifest(&self, r: &Reference, digest: &str) -> Result<bool> {
        let url = format!("{}/manifests/{digest}", self.base(r));
        self.exists(r, &url, &[(ACCEPT, OCI_MANIFEST)]).await
    }

    /// Stores `manifest` as `target` (a tag or its digest).
    pub async fn put_manifest(&self, r: &Reference, target: &str, manifest: Bytes) -> Result<()> {
        let url = format!("{}/manifests/{target}", self.base(r));
        let resp = self
            .send(
                r,
                Access::Push,
                Method::PUT,
                &url,
                &[(CONTENT_TYPE, OCI_MANIFEST)],
                manifest,
            )
            .await?;
        expect(
            resp,
            &[StatusCode::CREATED, StatusCode::OK],
            &format!("storing manifest {target}"),
        )
        .await
        .map(drop)
    }

    /// Whether the repository has blob `digest`.
    pub async fn has_blob(&self, r: &Reference, digest: &str) -> Result<bool> {
        let url = format!("{}/blobs/{digest}", self.base(r));
        self.exists(r, &url, &[]).await
    }

    /// Uploads blob `digest` of `size` bytes, its chunks arriving on
    /// `chunks`; the registry checks the digest when the upload completes.
    pub async fn upload(
        &self,
        r: &Reference,
        digest: &str,
        size: u64,
        mut chunks: mpsc::Receiver<std::io::Result<Bytes>>,
    ) -> Result<()> {
        let start = format!("{}/blobs/uploads/", self.base(r));
        let resp = self
            .send(r, Access::Push, Method::POST, &start, &[], Bytes::new())
            .await?;
        let resp = expect(resp, &[StatusCode::ACCEPTED], "starting an upload").await?;
        let mut location = location_of(&resp, &start)?;
        let mut sent = 0u64;
        while let Some(chunk) = chunks.recv().await {
            let chunk = chunk.map_err(Error::local("reading a snapshot file to upload"))?;
            if chunk.is_empty() {
                continue;
            }
            let end = sent + chunk.len() as u64 - 1;
            let range = format!("{sent}-{end}");
            let len = chunk.len().to_string();
            let resp = self
                .send(
                    r,
                    Access::Push,
                    Method::PATCH,
                    &location,
                    &[
                        (CONTENT_TYPE, "application/octet-stream"),
                        (CONTENT_RANGE, range.as_str()),
                        (CONTENT_LENGTH, len.as_str()),
                    ],
                    chunk,
                )
                .await?;
            let resp = expect(resp, &[StatusCode::ACCEPTED], "uploading a chunk").await?;
            location = location_of(&resp, &location)?;
            sent = end + 1;
        }
        if sent != size {
            return Err(Error::Transfer(format!(
                "blob {digest}: {sent} bytes read to upload, {size} expected (the file changed?)"
            )));
        }
        let sep = if location.contains('?') { '&' } else { '?' };
        let url = format!("{location}{sep}digest={digest}");
        let resp = self
            .send(
                r,
                Access::Push,
                Method::PUT,
                &url,
                &[(CONTENT_LENGTH, "0")],
                Bytes::new(),
            )
            .await?;
        expect(
            resp,
            &[StatusCode::CREATED],
            &format!("completing the upload of {digest}"),
        )
        .await
        .map(drop)
    }

    /// Blob `digest`'s response (body not yet read), following redirects.
    pub async fn blob(&self, r: &Reference, digest: &str) -> Result<Response<Incoming>> {
        check_digest(digest)?;
        let mut url = format!("{}/blobs/{digest}", self.base(r));
        for _ in 0..4 {
            let resp = self
                .send(r, Access::Pull, Method::GET, &url, &[], Bytes::new())
                .await?;
            if resp.status().is_redirection() {
                url = location_of(&resp, &url)?;
                continue;
            }
            return expect(resp, &[StatusCode::OK], &format!("blob {digest}")).await;
        }
        Err(Error::Registry(format!(
            "blob {digest}: too many redirects"
        )))
    }

    /// Bytes `start..start + len` of blob `digest` (an HTTP range request,
    /// redirects followed): the registry must answer `206 Partial Content`
    /// with exactly that many bytes. The caller verifies them (the blob's
    /// digest covers the whole blob only).
    pub async fn blob_range(
        &self,
        r: &Reference,
        digest: &str,
        start: u64,
        len: u64,
    ) -> Result<Bytes> {
        check_digest(digest)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        let last = start
            .checked_add(len - 1)
            .ok_or_else(|| Error::Invalid(format!("blob {digest}: range {start}+{len}")))?;
        let what = format!("blob {digest} bytes {start}-{last}");
        let range = format!("bytes={start}-{last}");
        let mut url = format!("{}/blobs/{digest}", self.base(r));
        for _ in 0..4 {
            let resp = self
                .send(
                    r,
                    Access::Pull,
                    Method::GET,
                    &url,
                    &[(RANGE, range.as_str())],
                    Bytes::new(),
                )
                .await?;
            if resp.status().is_redirection() {
                url = location_of(&resp, &url)?;
                continue;
            }
            if resp.status() == StatusCode::OK {
                return Err(Error::Registry(format!(
                    "{what}: the registry answered the whole blob (200), not the range"
                )));
            }
            let resp = expect(resp, &[StatusCode::PARTIAL_CONTENT], &what).await?;
            let body = read_limited(resp.into_body(), len as usize, &what).await?;
            if body.len() as u64 != len {
                return Err(Error::Transfer(format!(
                    "{what}: {} bytes arrived, {len} asked for",
                    body.len()
                )));
            }
            return Ok(Bytes::from(body));
        }
        Err(Error::Registry(format!("{what}: too many redirects")))
    }

    /// A small blob (a config) read whole, its digest checked.
    pub async fn blob_bytes(&self, r: &Reference, digest: &str, max: usize) -> Result<Vec<u8>> {
        let resp = self.blob(r, digest).await?;
        let body = read_limited(resp.into_body(), max, "a config blob").await?;
        if digest_of(&body) != digest {
            return Err(Error::Corrupt(format!(
                "blob {digest} arrived with digest {}",
                digest_of(&body)
            )));
        }
        Ok(body)
    }

    async fn exists(
        &self,
        r: &Reference,
        url: &str,
        headers: &[(http::HeaderName, &str)],
    ) -> Result<bool> {
        let resp = self
            .send(r, Access::Pull, Method::HEAD, url, headers, Bytes::new())
            .await?;
        match resp.status() {
            StatusCode::OK => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            _ => expect(resp, &[], url).await.map(|_| false),
        }
    }

    /// Sends a request, authenticating once if the registry asks.
    async fn send(
        &self,
        r: &Reference,
        access: Access,
        method: Method,
        url: &str,
        headers: &[(http::HeaderName, &str)],
        body: Bytes,
    ) -> Result<Response<Incoming>> {
        let scope = format!(
            "repository:{}:{}",
            r.repository,
            if access == Access::Push {
                "pull,push"
            } else {
                "pull"
            }
        );
        let key = (r.registry.clone(), scope.clone());
        let mut auth = self
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned();
        for attempt in 0..2 {
            let mut req = Request::builder().method(method.clone()).uri(url);
            for (k, v) in headers {
                req = req.header(k, *v);
            }
            if let Some(a) = &auth {
                req = req.header(AUTHORIZATION, a);
            }
            let req = req
                .body(Full::new(body.clone()))
                .map_err(|e| Error::Invalid(format!("request to {url}: {e}")))?;
            let resp = tokio::time::timeout(ANSWER, self.http.request(req))
                .await
                .map_err(|_| Error::Unreachable(format!("{url}: no answer within {ANSWER:?}")))?
                .map_err(|e| Error::Unreachable(format!("{url}: {}", chain(&e))))?;
            if resp.status() != StatusCode::UNAUTHORIZED || attempt == 1 {
                return Ok(resp);
            }
            let challenge = resp
                .headers()
                .get(WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            auth = Some(self.authenticate(r, &challenge, &scope).await?);
            self.tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key.clone(), auth.clone().unwrap_or_default());
        }
        Err(Error::Denied(format!(
            "{url}: refused after authenticating"
        )))
    }

    /// The `Authorization` value answering `challenge`.
    async fn authenticate(&self, r: &Reference, challenge: &str, scope: &str) -> Result<String> {
        let creds = self.creds.of(&r.registry);
        let basic = creds.map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        });
        let (kind, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        if kind.eq_ignore_ascii_case("basic") {
            return basic.ok_or_else(|| {
                Error::Denied(format!(
                    "{} asks for credentials and this node has none for it",
                    r.registry
                ))
            });
        }
        if !kind.eq_ignore_ascii_case("bearer") {
            return Err(Error::Denied(format!(
                "{}: unsupported authentication {challenge:?}",
                r.registry
            )));
        }
        let params = challenge_params(params);
        let realm = params.get("realm").ok_or_else(|| {
            Error::Registry(format!(
                "{}: a Bearer challenge without a realm",
                r.registry
            ))
        })?;
        let mut url = format!(
            "{realm}?scope={}",
            scope.replace(':', "%3A").replace(',', "%2C")
        );
        if let Some(s) = params.get("service") {
            url.push_str(&format!("&service={s}"));
        }
        let mut req = Request::builder().method(Method::GET).uri(&url);
        if let Some(b) = &basic {
            req = req.header(AUTHORIZATION, b);
        }
        let req = req
            .body(Full::new(Bytes::new()))
            .map_err(|e| Error::Invalid(format!("token request {url}: {e}")))?;
        let resp = tokio::time::timeout(ANSWER, self.http.request(req))
            .await
            .map_err(|_| Error::Unreachable(format!("{url}: no answer within {ANSWER:?}")))?
            .map_err(|e| Error::Unreachable(format!("{url}: {}", chain(&e))))?;
        let resp = expect(resp, &[StatusCode::OK], "getting a registry token").await?;
        let body = read_limited(resp.into_body(), 64 << 10, "a token").await?;
        #[derive(Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let t: Token = serde_json::from_slice(&body)
            .map_err(|e| Error::Registry(format!("the token service's answer: {e}")))?;
        t.token
            .or(t.access_token)
            .map(|t| format!("Bearer {t}"))
            .ok_or_else(|| Error::Registry("the token service answered no token".into()))
    }
}

fn challenge_params(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = s.trim();
    while let Some((k, v)) = rest.split_once('=') {
        let k = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let (value, after) = match v.strip_prefix('"') {
            Some(q) => match q.split_once('"') {
                Some((val, after)) => (val, after),
                None => (q, ""),
            },
            None => v.split_once(',').unwrap_or((v, "")),
        };
        out.insert(k, value.to_string());
        rest = after.trim_start_matches(',').trim();
    }
    out
}

/// `sha256:<hex>` of `bytes`.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// `resp` if its status is one of `ok`, else the error it means.
async fn expect(
    resp: Response<Incoming>,
    ok: &[StatusCode],
    what: &str,
) -> Result<Response<Incoming>> {
    let status = resp.status();
    if ok.contains(&status) {
        return Ok(resp);
    }
    let body = read_limited(resp.into_body(), 64 << 10, "an error")
        .await
        .unwrap_or_default();
    let detail = String::from_utf8_lossy(&body[..body.len().min(512)])
        .trim()
        .to_string();
    let msg = format!("{what}: {status} {detail}");
    Err(match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Error::Denied(msg),
        StatusCode::NOT_FOUND => Error::NotFound(msg),
        _ => Error::Registry(msg),
    })
}

/// The `Location` of `resp`, made absolute against `base`'s origin.
fn location_of(resp: &Response<Incoming>, base: &str) -> Result<String> {
    let loc = resp
        .headers()
        .get(LOCATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| Error::Registry(format!("{base}: an answer without a Location")))?;
    if loc.starts_with("http://") || loc.starts_with("https://") {
        return Ok(loc.to_string());
    }
    let origin_end = base
        .find("://")
        .and_then(|i| base[i + 3..].find('/').map(|j| i + 3 + j))
        .unwrap_or(base.len());
    Ok(format!("{}{loc}", &base[..origin_end]))
}

/// Reads a whole body of at most `max` bytes.
async fn read_limited(mut body: Incoming, max: usize, what: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(frame) = tokio::time::timeout(STALL, body.frame())
        .await
        .map_err(|_| Error::Transfer(format!("{what}: stalled for {STALL:?}")))?
    {
        let frame = frame.map_err(|e| Error::Transfer(format!("{what}: {}", chain(&e))))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > max {
                return Err(Error::Corrupt(format!("{what} is over {max} bytes")));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out)
}

/// The next data frame of a streamed body (`None` at its end).
pub(crate) async fn next_data(body: &mut Incoming, what: &str) -> Result<Option<Bytes>> {
    loop {
        let frame = tokio::time::timeout(STALL, body.frame())
            .await
            .map_err(|_| Error::Transfer(format!("{what}: stalled for {STALL:?}")))?;
        match frame {
            None => return Ok(None),
            Some(Err(e)) => return Err(Error::Transfer(format!("{what}: {}", chain(&e)))),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    return Ok(Some(d));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_config_credentials_parse() {
        let auth = base64::engine::general_purpose::STANDARD.encode("u:p:w");
        let c = Credentials::from_docker_config(
            format!(
                r#"{{"auths": {{"https://r.io/v1/": {{"auth": "{auth}"}}, "q.io:5000": {{"username": "a", "password": "b"}}}}}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(c.of("r.io"), Some(&("u".into(), "p:w".into())));
        assert_eq!(c.of("q.io:5000"), Some(&("a".into(), "b".into())));
        assert!(c.of("other.io").is_none());
        for bad in [
            r#"{"auths": {"r.io": {}}}"#,
            r#"{"auths": {"r.io": {"auth": "!!"}}}"#,
            r#"{"auths": 3}"#,
        ] {
            assert!(
                Credentials::from_docker_config(bad.as_bytes()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_node_without_ca_certificates_still_makes_a_client() {
        // Where rustls-native-certs looks when told: an empty file.
        let empty = tempfile::NamedTempFile::new().unwrap();
        let none = tempfile::tempdir().unwrap();
        std::env::set_var("SSL_CERT_FILE", empty.path());
        std::env::set_var("SSL_CERT_DIR", none.path());
        assert!(hyper_rustls::HttpsConnectorBuilder::new()
            .with_native_roots()
            .is_err());
        Client::new(Credentials::default(), vec![]).unwrap();
    }

    #[test]
    fn bearer_challenges_parse() {
        let p = challenge_params(
            r#"realm="https://auth.r.io/token",service="r.io",scope="repository:a:pull""#,
        );
        assert_eq!(p["realm"], "https://auth.r.io/token");
        assert_eq!(p["service"], "r.io");
        assert_eq!(p["scope"], "repository:a:pull");
    }
}
