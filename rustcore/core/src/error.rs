//! The one error type of the core. Every variant names what is wrong (node, field,
//! op) so that a user reading the Python exception knows where to look; the bindings
//! map each variant onto a class of `hapd.errors` by [`Error::kind`].

use thiserror::Error;

/// Result alias used throughout the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the core on bad input. A panic is a bug.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// The bytes are not a msgpack document of the expected shape.
    #[error("cannot decode {what}: {message}")]
    Decode { what: &'static str, message: String },

    /// The file declares another format than the one expected.
    #[error("unknown format {found:?} (expected {expected:?})")]
    UnknownFormat { found: String, expected: &'static str },

    /// The file's version is not one this build reads.
    #[error("unsupported {format} version {found} (this hapd reads version {supported})")]
    UnsupportedVersion { format: &'static str, found: i64, supported: u32 },

    /// A field of a node is missing or has a bad value.
    #[error("node {index} ({name}): field `{field}`: {message}")]
    InvalidNode { index: usize, name: String, field: String, message: String },

    /// A node refers to a tensor that does not exist (yet).
    #[error("node {index} ({name}): input {input} refers to {target}, {message}")]
    DanglingRef { index: usize, name: String, input: usize, target: String, message: String },

    /// Shapes or ranks of an op's operands do not agree with the op.
    #[error("node {name} ({op}): {message}")]
    ShapeMismatch { name: String, op: String, message: String },

    /// A field of the graph (not of one node) is missing or bad.
    #[error("graph field `{field}`: {message}")]
    InvalidGraph { field: String, message: String },

    /// A cluster profile is missing a field or has a bad value.
    #[error("profile field `{field}`: {message}")]
    InvalidProfile { field: String, message: String },

    /// The search found no program (should not happen while replicated rules exist).
    #[error("synthesis failed: {message}")]
    Synthesis { message: String },

    /// Options passed to the compiler are inconsistent.
    #[error("option `{field}`: {message}")]
    InvalidOption { field: String, message: String },
}

impl Error {
    /// Stable name of the Python exception class this error becomes.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Decode { .. } => "GraphFormatError",
            Error::UnknownFormat { .. } => "GraphFormatError",
            Error::UnsupportedVersion { .. } => "GraphVersionError",
            Error::InvalidNode { .. } | Error::DanglingRef { .. } | Error::InvalidGraph { .. } => {
                "GraphValidationError"
            }
            Error::ShapeMismatch { .. } => "ShapeError",
            Error::InvalidProfile { .. } => "ProfileError",
            Error::Synthesis { .. } => "SynthesisError",
            Error::InvalidOption { .. } => "OptionsError",
        }
    }

    /// The node this error is about, when there is one.
    pub fn node(&self) -> Option<&str> {
        match self {
            Error::InvalidNode { name, .. }
            | Error::DanglingRef { name, .. }
            | Error::ShapeMismatch { name, .. } => Some(name),
            _ => None,
        }
    }

    /// The field this error is about, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::InvalidNode { field, .. }
            | Error::InvalidGraph { field, .. }
            | Error::InvalidProfile { field, .. }
            | Error::InvalidOption { field, .. } => Some(field),
            Error::DanglingRef { .. } => Some("inputs"),
            _ => None,
        }
    }

    pub(crate) fn node_field(
        index: usize,
        name: &str,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::InvalidNode { index, name: name.to_string(), field: field.into(), message: message.into() }
    }

    pub(crate) fn shape(name: &str, op: &str, message: impl Into<String>) -> Self {
        Error::ShapeMismatch { name: name.to_string(), op: op.to_string(), message: message.into() }
    }
}
