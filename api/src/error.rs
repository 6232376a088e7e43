//! Errors as E2B's API gives them: an HTTP status and the body
//! `{"code": <status>, "message": "..."}` its SDKs read.

use serde_json::json;

/// An answer other than success, with the status E2B's API would give.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// What went wrong, for people.
    pub message: String,
}

impl ApiError {
    /// An error of `status`.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// 400: the request is malformed or invalid.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    /// 401: no key, or not a tenant's.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(401, message)
    }

    /// 404: no such sandbox, template or snapshot in the caller's namespace.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, message)
    }

    /// 409: the sandbox is not in a state that allows the call.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, message)
    }

    /// 500: Twig failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"code": self.status, "message": self.message})
    }
}

impl From<kube::Error> for ApiError {
    fn from(e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(status) if status.code == 404 => {
                Self::not_found(status.message.clone())
            }
            kube::Error::Api(status) if status.code == 409 => {
                Self::conflict(status.message.clone())
            }
            kube::Error::Api(status) if status.code == 422 || status.code == 400 => {
                Self::bad_request(status.message.clone())
            }
            _ => Self::internal(format!("Kubernetes API: {e}")),
        }
    }
}
