//! twig-api as a client of a sandbox's envd (twig-agent's in-sandbox API):
//! `POST /init` after every start, restore and fork.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::HttpClient;

/// How long a just-Ready pod's envd may take to answer.
const INIT_DEADLINE: Duration = Duration::from_secs(10);

/// Sends `body` to `POST http://<ip>:<port>/init`, with `X-Access-Token:
/// old` when envd holds a token already (a clone's source's); retries
/// refused connections until [`INIT_DEADLINE`].
pub async fn init(
    http: &HttpClient,
    ip: &str,
    port: u16,
    old: Option<&str>,
    body: &serde_json::Value,
) -> Result<(), String> {
    let uri = format!("http://{}/init", host_port(ip, port));
    let payload = Bytes::from(body.to_string());
    let started = Instant::now();
    let mut pause = Duration::from_millis(20);
    loop {
        let mut req =
            http::Request::post(&uri).header(http::header::CONTENT_TYPE, "application/json");
        if let Some(token) = old {
            req = req.header("X-Access-Token", token);
        }
        let req = req
            .body(crate::boxed(Full::new(payload.clone())))
            .map_err(|e| e.to_string())?;
        match http.request(req).await {
            Ok(res) if res.status().is_success() => return Ok(()),
            Ok(res) => {
                let status = res.status();
                let text = res
                    .into_body()
                    .collect()
                    .await
                    .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                    .unwrap_or_default();
                return Err(format!("POST {uri}: {status} {text}"));
            }
            Err(e) if started.elapsed() < INIT_DEADLINE => {
                tracing::debug!("POST {uri}: {e}; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            Err(e) => return Err(format!("POST {uri}: {e}")),
        }
    }
}

/// `ip:port`, bracketing an IPv6 address.
pub fn host_port(ip: &str, port: u16) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}
