//! The JetStream API's errors: one table of every error Keel answers with, each with the
//! reference's HTTP-like `code`, its NATS `err_code` and its description (`{}` marks where a
//! detail goes, as the reference's `{err}` and `{seq}` placeholders do). Nothing else in
//! JetStream writes an error code: an [`ApiError`] is only made from an [`ErrorKind`].

use serde_json::Value;

/// An API error as the reference reports it: HTTP-like `code`, NATS `err_code`, text.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ApiError {
    pub code: u16,
    pub err_code: u32,
    pub description: String,
}

impl ApiError {
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("errors serialize")
    }

    /// A feature Keel refuses rather than ignores (an invalid-config error naming it).
    pub fn not_supported(what: &str) -> Self {
        ErrorKind::InvalidConfig.with(format!("{what} is not supported by keel-server yet"))
    }

    /// A request body that is not valid JSON, in Go's words.
    pub fn invalid_json_body(body: &[u8], e: &serde_json::Error) -> Self {
        ErrorKind::InvalidJson.with(super::decode::go_json_error(body, e, true))
    }
}

macro_rules! error_table {
    ($($(#[$doc:meta])* $name:ident = ($code:literal, $err:literal, $desc:literal);)*) => {
        /// Every JetStream API error: see the module docs.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum ErrorKind {
            $($(#[$doc])* $name,)*
        }

        impl ErrorKind {
            /// (code, err_code, description) of this error.
            pub const fn entry(self) -> (u16, u32, &'static str) {
                match self {
                    $(ErrorKind::$name => ($code, $err, $desc),)*
                }
            }

            /// Every entry, for the table's own checks.
            #[cfg(test)]
            const ALL: &'static [ErrorKind] = &[$(ErrorKind::$name,)*];
        }
    };
}

impl ErrorKind {
    /// The error with its description as the table has it.
    pub fn err(self) -> ApiError {
        let (code, err_code, desc) = self.entry();
        debug_assert!(!desc.contains("{}"), "{self:?} needs a detail");
        ApiError {
            code,
            err_code,
            description: desc.to_string(),
        }
    }

    /// The error with `detail` in its description's `{}`.
    pub fn with(self, detail: impl std::fmt::Display) -> ApiError {
        let (code, err_code, desc) = self.entry();
        debug_assert!(desc.contains("{}"), "{self:?} takes no detail");
        ApiError {
            code,
            err_code,
            description: desc.replacen("{}", &detail.to_string(), 1),
        }
    }
}

error_table! {
    // Requests.
    BadRequest = (400, 10003, "bad request");
    InvalidJson = (400, 10025, "invalid JSON: {}");
    NotEmptyRequest = (400, 10038, "expected an empty request payload");
    // Streams.
    InsufficientMemory = (500, 10028, "insufficient memory resources available");
    InsufficientStorage = (500, 10047, "insufficient storage resources available");
    MaxStreams = (400, 10027, "maximum number of streams reached");
    MirrorMaxMessageSize = (400, 10030, "stream mirror must have max message size >= source");
    MirrorWithSources = (400, 10031, "stream mirrors can not also contain other sources");
    MirrorWithSubjects = (400, 10034, "stream mirrors can not contain subjects");
    NoMessageFound = (404, 10037, "no message found");
    SequenceNotFound = (400, 10043, "sequence {} not found");
    SourceMaxMessageSize = (400, 10046, "stream source must have max message size >= target");
    /// Creating a stream failed (the reason as detail).
    StreamCreate = (500, 10049, "{}");
    /// The config is invalid (the reason as detail).
    InvalidConfig = (500, 10052, "{}");
    MessageTooLarge = (400, 10054, "message size exceeds maximum allowed");
    MirrorConfigUpdate = (400, 10055, "stream mirror configuration can not be updated");
    StreamMismatch = (400, 10056, "stream name in subject does not match request");
    MsgDeleteFailed = (500, 10057, "{}");
    StreamNameInUse = (400, 10058, "stream name already in use with a different configuration");
    StreamNotFound = (404, 10059, "stream not found");
    ExpectedStreamMismatch = (400, 10060, "expected stream does not match");
    SubjectsOverlap = (400, 10065, "subjects overlap with an existing stream");
    UpdateFailed = (500, 10069, "{}");
    WrongLastMsgId = (400, 10070, "wrong last msg ID: {}");
    WrongLastSequence = (400, 10071, "wrong last sequence: {}");
    ReplicasNotSupported = (500, 10074, "replicas > 1 not supported in non-clustered mode");
    // Clusters.
    NoSuitablePeers = (400, 10005, "no suitable peers for placement");
    /// The same with the reason appended (`, tags not matched ['x']`).
    NoSuitablePeersReason = (400, 10005, "no suitable peers for placement{}");
    /// The same code with only the reason (a stepdown's placement that cannot be met).
    NoPeers = (400, 10005, "{}");
    ClusterUnavailable = (503, 10008, "JetStream system temporarily unavailable");
    /// JetStream disabled on this server (removed from its cluster) and no other to ask.
    NotEnabled = (503, 10076, "JetStream not enabled");
    /// An account without JetStream on a server with it (`not_enabled`).
    NotEnabledForAccount = (503, 10039, "JetStream not enabled for account");
    ClusteringRequired = (503, 10010, "JetStream clustering support required");
    PeerNotMember = (400, 10040, "peer not a member");
    ServerNotMember = (400, 10044, "server is not a member of the cluster");
    MemberChangeInflight = (400, 10202, "cluster member change is in progress");
    PeerRemap = (503, 10075, "peer remap failed");
    ConsumerReplicasExceedStream = (400, 10126, "consumer config replica count exceeds parent stream");
    /// A stepdown that could not be done (the reason as detail).
    StepdownFailed = (500, 10041, "{}");
    /// Storing failed (limits with discard new, a storage failure: the reason as detail).
    StoreFailed = (503, 10077, "{}");
    HeaderTooLarge = (400, 10097, "header size exceeds maximum allowed of 64k");
    MaxBytesRequired = (400, 10113, "account requires a stream config to have max bytes set");
    StreamMaxBytesExceedsAccount = (400, 10122, "stream max bytes exceeds account limit max stream bytes");
    Sealed = (400, 10109, "invalid operation on sealed stream");
    PurgeFailed = (500, 10110, "{}");
    RollupFailed = (500, 10111, "{}");
    ReplicasNegative = (400, 10133, "replicas count cannot be negative");
    DuplicateSource = (400, 10140, "duplicate source configuration detected");
    SourceNameInvalid = (400, 10141, "sourced stream name is invalid");
    MirrorNameInvalid = (400, 10142, "mirrored stream name is invalid");
    MirrorWithFirstSeq = (400, 10143, "stream mirrors can not have first sequence configured");
    SourceTransformsAndFilter = (400, 10144, "source with multiple subject transforms cannot also have a single subject filter");
    SourceTransformSource = (400, 10145, "source transform source: invalid subject {}");
    SourceTransform = (400, 10146, "source transform: {}");
    SourceFiltersOverlap = (400, 10147, "source filters can not overlap");
    MirrorTransformsAndFilter = (400, 10150, "mirror with multiple subject transforms cannot also have a single subject filter");
    MirrorTransformSource = (400, 10151, "mirror transform source: invalid subject {}");
    MirrorFiltersOverlap = (400, 10152, "mirror subject filters can not overlap");
    MirrorTransform = (400, 10154, "mirror transform: {}");
    StreamTransformSource = (400, 10155, "stream transform source: invalid subject {}");
    StreamTransform = (400, 10156, "stream transform: {}");
    MsgTtlInvalid = (400, 10165, "invalid per-message TTL");
    MsgTtlDisabled = (400, 10166, "per-message TTL is disabled");
    MsgCounterDisabled = (400, 10168, "message counters is disabled");
    MsgCounterMissing = (400, 10169, "message counter increment is missing");
    MsgCounterPayload = (400, 10170, "message counter has payload");
    MsgCounterInvalid = (400, 10171, "message counter increment is invalid");
    MsgCounterBroken = (400, 10172, "message counter is broken");
    MirrorWithCounters = (400, 10173, "stream mirrors can not also calculate counters");
    StreamSourceHeader = (400, 10227, "message stream source header is not allowed");
    // Consumers.
    ConsumerCreate = (500, 10012, "{}");
    ConsumerNotFound = (404, 10014, "consumer not found");
    ConsumerDurableMismatch = (400, 10017, "consumer name in subject does not match durable name in request");
    ConsumerDurableNotSet = (400, 10018, "consumer expected to be durable but a durable name was not set");
    ConsumerEphemeralWithDurable = (400, 10020, "consumer expected to be ephemeral but a durable name was set in request");
    MaxConsumers = (400, 10026, "maximum consumers limit reached");
    ConsumerDeliverSubjectWildcards = (400, 10079, "consumer deliver subject has wildcards");
    ConsumerPushMaxWaiting = (400, 10080, "consumer in push mode can not set max waiting");
    ConsumerDeliverCycle = (400, 10081, "consumer deliver subject forms a cycle");
    ConsumerHeartbeatTooShort = (400, 10083, "consumer idle heartbeat needs to be >= 100ms");
    ConsumerPullWorkqueueAck = (400, 10084, "consumer in pull mode requires explicit ack policy on workqueue stream");
    ConsumerPullRateLimit = (400, 10086, "consumer in pull mode can not have rate limit set");
    ConsumerMaxWaitingNegative = (400, 10087, "consumer max waiting needs to be positive");
    ConsumerHeartbeatPull = (400, 10088, "consumer idle heartbeat requires a push based consumer");
    ConsumerFlowControlPull = (400, 10089, "consumer flow control requires a push based consumer");
    /// The deliver policy and its options disagree (which way as detail).
    ConsumerInvalidPolicy = (400, 10094, "{}");
    ConsumerSampleFrequency = (400, 10095, "failed to parse consumer sampling configuration: {}");
    WorkqueueExplicitAck = (400, 10098, "workqueue stream requires explicit ack");
    WorkqueueMultipleUnfiltered = (400, 10099, "multiple non-filtered consumers not allowed on workqueue stream");
    WorkqueueNotUnique = (400, 10100, "filtered consumer not unique on workqueue stream");
    WorkqueueDeliverAll = (400, 10101, "consumer must be deliver all on workqueue stream");
    ConsumerNameTooLong = (400, 10102, "consumer name is too long, maximum allowed is 255");
    ConsumerStore = (500, 10104, "error creating store for consumer: {}");
    ConsumerFlowControlHeartbeat = (400, 10108, "consumer with flow control also needs heartbeats");
    ConsumerMaxAckPendingExceeds = (400, 10121, "consumer max ack pending exceeds system limit of {}");
    ConsumerMaxRequestBatch = (400, 10114, "consumer max request batch needs to be > 0");
    ConsumerMaxRequestBatchExceeds = (400, 10125, "consumer max request batch exceeds server limit of {}");
    ConsumerMaxRequestExpires = (400, 10115, "consumer max request expires needs to be >= 1ms");
    ConsumerBackoffMaxDeliver = (400, 10116, "max deliver is required to be > length of backoff values");
    ConsumerNamePathSeparators = (400, 10127, "Consumer name can not contain path separators");
    ConsumerFilterMismatch = (400, 10131, "Consumer create request did not match filtered subject from create subject");
    ConsumerDurableNameNotEqual = (400, 10132, "Consumer Durable and Name have to be equal if both are provided");
    ConsumerFilterAndFilters = (400, 10136, "consumer cannot have both FilterSubject and FilterSubjects specified");
    ConsumerMultipleFilters = (400, 10137, "consumer with multiple subject filters cannot use subject based API");
    ConsumerFiltersOverlap = (400, 10138, "consumer subject filters cannot overlap");
    ConsumerEmptyFilter = (400, 10139, "consumer filter in FilterSubjects cannot be empty");
    ConsumerAlreadyExists = (400, 10148, "consumer already exists");
    ConsumerDoesNotExist = (400, 10149, "consumer does not exist");
    ConsumerPriorityGroupUnknown = (400, 10160, "Provided priority group does not exist for this consumer");
    ConsumerEmptyGroupName = (400, 10161, "Group name cannot be an empty string");
    ConsumerInvalidGroupName = (400, 10162, "Valid priority group name must match A-Z, a-z, 0-9, -_/=)+ and may not exceed 16 characters");
    ConsumerPushPriorityGroups = (400, 10178, "priority groups can not be used with push consumers");
    ConsumerPriorityPolicyWithoutGroup = (400, 10159, "Setting PriorityPolicy requires at least one PriorityGroup to be set");
    ConsumerAckWaitNegative = (400, 10183, "consumer ack wait needs to be positive");
    ConsumerBackoffNegative = (400, 10184, "consumer backoff needs to be positive");
    ConsumerGroupsWithoutPolicy = (400, 10196, "consumer can not have priority groups when policy is none");
    ConsumerPinnedTtlWithoutPolicy = (400, 10197, "PinnedTTL cannot be set when PriorityPolicy is none");
    ConsumerInvalidReset = (400, 10204, "invalid reset: {}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_error() {
        let mut seen = std::collections::HashSet::new();
        for k in ErrorKind::ALL {
            let (code, err_code, desc) = k.entry();
            assert!(matches!(code, 400 | 404 | 500 | 503), "{k:?}");
            assert!(seen.insert((err_code, desc)), "{k:?} twice");
            assert!(desc.matches("{}").count() <= 1, "{k:?}");
        }
        assert_eq!(
            ErrorKind::WrongLastSequence.with(7).description,
            "wrong last sequence: 7"
        );
        assert_eq!(
            ErrorKind::StreamNotFound.err().to_json().to_string(),
            r#"{"code":404,"err_code":10059,"description":"stream not found"}"#
        );
    }
}
