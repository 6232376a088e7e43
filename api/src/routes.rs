//! The control plane's HTTP routes: E2B's REST API (the SDK 2.63's paths
//! and status codes) and CubeSandbox's additions, each on the namespace of
//! the caller's API key.

use std::collections::BTreeMap;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::error::ApiError;
use crate::model::{Connect, Fork, NewSandbox, NewSnapshot, RollbackRequest, SetTimeout};
use crate::{json_response, App, Body};

/// Largest request body the control plane reads.
const MAX_BODY: usize = 1 << 20;
/// Most sandboxes one list page holds.
const MAX_PAGE: usize = 1000;

/// The query parameters; a repeated one keeps every value.
fn query(req: &Request<Incoming>) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, v) in form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()) {
        out.entry(k.into_owned()).or_default().push(v.into_owned());
    }
    out
}

fn first<'a>(q: &'a BTreeMap<String, Vec<String>>, key: &str) -> Option<&'a str> {
    q.get(key).and_then(|v| v.first()).map(String::as_str)
}

/// A JSON body as `T` (an empty body is `{}`).
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let text: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(text)
        .map_err(|e| ApiError::bad_request(format!("Error when parsing request: {e}")))
}

fn no_content() -> Response<Body> {
    let mut res = Response::new(crate::boxed(Full::new(Bytes::new())));
    *res.status_mut() = StatusCode::NO_CONTENT;
    res
}

fn ok<T: serde::Serialize>(status: StatusCode, value: &T) -> Result<Response<Body>, ApiError> {
    let value = serde_json::to_value(value).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(json_response(status, &value))
}

impl App {
    /// Serves one control-plane request.
    pub async fn control(&self, req: Request<Incoming>) -> Response<Body> {
        match self.control_inner(req).await {
            Ok(res) => res,
            Err(e) => {
                if e.status >= 500 {
                    tracing::warn!("{e}");
                }
                let status =
                    StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                json_response(status, &e.body())
            }
        }
    }

    async fn control_inner(&self, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        if method == Method::GET && segs == ["health"] {
            return ok(StatusCode::OK, &json!({"status": "ok"}));
        }
        let key = req
            .headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ApiError::unauthorized("missing API key: set the X-API-Key header"))?;
        let ns = self
            .tenants
            .namespace_of(key)
            .ok_or_else(|| ApiError::unauthorized("Invalid API key"))?
            .to_string();
        let q = query(&req);
        let body = Limited::new(req.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))?
            .to_bytes();
        let ns = ns.as_str();
        match (&method, segs.as_slice()) {
            (&Method::POST, ["v2", "sandboxes"] | ["sandboxes"]) => {
                let sandbox = self.create(ns, parse::<NewSandbox>(&body)?).await?;
                ok(StatusCode::CREATED, &sandbox)
            }
            (&Method::GET, ["v2", "sandboxes"]) => self.list_page(ns, &q, None).await,
            (&Method::GET, ["sandboxes"]) => self.list_page(ns, &q, Some("running")).await,
            (&Method::GET, ["sandboxes", id]) => {
                let found = self.find(ns, id).await?;
                ok(StatusCode::OK, &self.detail(ns, &found))
            }
            (&Method::DELETE, ["sandboxes", id]) => {
                self.kill(ns, id).await?;
                Ok(no_content())
            }
            (&Method::POST, ["sandboxes", id, "timeout"]) => {
                let t = parse::<SetTimeout>(&body)?;
                self.set_timeout(ns, id, t.timeout).await?;
                Ok(no_content())
            }
            (&Method::POST, ["sandboxes", id, "pause"]) => {
                self.pause(ns, id).await?;
                Ok(no_content())
            }
            (
                &Method::POST,
                ["v2", "sandboxes", id, "connect"]
                | ["sandboxes", id, "connect"]
                | ["sandboxes", id, "resume"],
            ) => {
                let c = parse::<Connect>(&body)?;
                let (sandbox, resumed) = self.connect(ns, id, c.timeout).await?;
                let status = if resumed {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                ok(status, &sandbox)
            }
            (&Method::POST, ["sandboxes", id, "fork"]) => {
                let f = parse::<Fork>(&body)?;
                ok(
                    StatusCode::CREATED,
                    &self.fork(ns, id, f.count, f.timeout).await?,
                )
            }
            (&Method::POST, ["sandboxes", id, "snapshots"]) => {
                let s = parse::<NewSnapshot>(&body)?;
                if s.memory == Some(false) {
                    return Err(ApiError::bad_request(
                        "filesystem-only snapshots are not supported: a Twig snapshot holds memory and disks together",
                    ));
                }
                ok(StatusCode::CREATED, &self.snapshot(ns, id, s.name).await?)
            }
            (&Method::GET, ["snapshots"]) => {
                let of = first(&q, "sandboxID");
                ok(StatusCode::OK, &self.snapshots(ns, of).await?)
            }
            (&Method::DELETE, ["templates", snap]) => {
                self.delete_snapshot(ns, snap).await?;
                Ok(no_content())
            }
            (&Method::POST, ["sandboxes", id, "rollback"]) => {
                let r = parse::<RollbackRequest>(&body)?;
                self.rollback(ns, id, &r.snapshot_id).await?;
                ok(
                    StatusCode::OK,
                    &json!({"sandboxID": id, "snapshotID": r.snapshot_id, "status": "success"}),
                )
            }
            (&Method::GET, ["sandboxes", id, "metrics"]) => {
                self.find(ns, id).await?;
                ok(StatusCode::OK, &json!([]))
            }
            _ => Err(ApiError::not_found(format!(
                "{method} {path} is not part of the API"
            ))),
        }
    }

    /// A page of the list, after `nextToken` (a sandbox ID), at most
    /// `limit`; the next page's token in `x-next-token`.
    async fn list_page(
        &self,
        ns: &str,
        q: &BTreeMap<String, Vec<String>>,
        only: Option<&str>,
    ) -> Result<Response<Body>, ApiError> {
        let states: Vec<String> = match only {
            Some(state) => vec![state.to_string()],
            None => q
                .get("state")
                .into_iter()
                .flatten()
                .flat_map(|s| s.split(','))
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        };
        if let Some(bad) = states.iter().find(|s| *s != "running" && *s != "paused") {
            return Err(ApiError::bad_request(format!(
                "state {bad:?} is neither running nor paused"
            )));
        }
        let metadata: BTreeMap<String, String> = first(q, "metadata")
            .map(|m| {
                form_urlencoded::parse(m.as_bytes())
                    .map(|(k, v)| (k.into_owned(), v.into_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let limit = match first(q, "limit") {
            Some(l) => l
                .parse::<usize>()
                .ok()
                .filter(|l| (1..=MAX_PAGE).contains(l))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("limit must be between 1 and {MAX_PAGE}"))
                })?,
            None => MAX_PAGE,
        };
        let after = first(q, "nextToken").unwrap_or_default();
        let all = self.list(ns, &states, &metadata).await?;
        let mut page: Vec<_> = all
            .into_iter()
            .filter(|s| s.sandbox_id.as_str() > after)
            .collect();
        let more = page.len() > limit;
        page.truncate(limit);
        let mut res = ok(StatusCode::OK, &page)?;
        if let (true, Some(last)) = (more, page.last()) {
            if let Ok(v) = http::HeaderValue::from_str(&last.sandbox_id) {
                res.headers_mut().insert("x-next-token", v);
            }
        }
        Ok(res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NewSandbox;

    #[test]
    fn bodies_parse_or_say_why() {
        let empty: Connect = parse(&Bytes::from_static(b"")).expect("empty");
        assert_eq!(empty.timeout, None);
        let made: NewSandbox = parse(&Bytes::from_static(
            br#"{"templateID":"base","timeout":30,"extra":1}"#,
        ))
        .expect("create");
        assert_eq!(made.template_id, "base");
        let bad = parse::<NewSandbox>(&Bytes::from_static(b"{\"timeout\":1}")).unwrap_err();
        assert_eq!(bad.status, 400);
        assert!(bad.message.contains("templateID"), "{}", bad.message);
        assert_eq!(
            parse::<SetTimeout>(&Bytes::from_static(b"["))
                .unwrap_err()
                .status,
            400
        );
    }
}
