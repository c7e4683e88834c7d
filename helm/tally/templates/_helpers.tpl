{{/*
Names. Every object is named <fullname>-<component>; fullname is the release name
(with "-tally" unless it already says tally), short enough that a StatefulSet's pods
and controller revisions stay within Kubernetes' 63-character limits.
*/}}
{{- define "tally.fullname" -}}
{{- $name := .Release.Name -}}
{{- if not (contains "tally" $name) -}}{{- $name = printf "%s-tally" $name -}}{{- end -}}
{{- $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "tally.labels" -}}
app.kubernetes.io/name: tally
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "counter"). */}}
{{- define "tally.selector" -}}
app.kubernetes.io/name: tally
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The number of counter shards: the partitions of the built-in shards topic
(topics/topics.toml; scripts/deploy-checks.sh checks they agree). */}}
{{- define "tally.shards" -}}8{{- end -}}

{{- define "tally.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* A queue name as a Kubernetes name: lowercase, `_` → `-`, no leading or trailing `-`. */}}
{{- define "tally.queueSlug" -}}
{{- $slug := . | toString | lower | replace "_" "-" | trimAll "-" -}}
{{- if not $slug -}}
{{- fail (printf "queue %q: the name needs a letter or digit to name its Kubernetes objects" (toString .)) -}}
{{- end -}}
{{- $slug -}}
{{- end -}}

{{/* The worker Deployment of a queue: (dict "root" $ "queue" "emails_high"); at most
63 characters (cut, with a hash of the queue name, when longer). */}}
{{- define "tally.workerName" -}}
{{- $name := printf "%s-worker-%s" (include "tally.fullname" .root) (include "tally.queueSlug" .queue) -}}
{{- if gt (len $name) 63 -}}
{{- $name = printf "%s-%s" (regexReplaceAll "-+$" (trunc 54 $name) "") (sha256sum (toString .queue) | trunc 8) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Every queue a worker may serve, as a JSON list: the built-in `default` and the
declared ones. */}}
{{- define "tally.queueNames" -}}
{{- $names := list "default" -}}
{{- range .Values.queues -}}{{- $names = append $names (toString .name) -}}{{- end -}}
{{- $names | uniq | toJson -}}
{{- end -}}

{{/*
Checks that go beyond values.schema.json; included by configmap.yaml, so a values
file that fails any of them fails the whole render with its message.
*/}}
{{- define "tally.validate" -}}
{{- $v := .Values -}}
{{- if not (toString $v.kafka.bootstrapServers | trim) -}}
{{- fail "kafka.bootstrapServers is required: the host:port list of your Kafka" -}}
{{- end -}}
{{- $shards := include "tally.shards" . | int -}}
{{- if gt (int $v.counter.replicas) $shards -}}
{{- fail (printf "counter.replicas is %d but there are only %d shards (the partitions of the shards topic): at most %d counter replicas, the others would never own a shard nor become ready" (int $v.counter.replicas) $shards $shards) -}}
{{- end -}}
{{- /* Queues: valid, distinct names (also as Kubernetes names), coherent settings. */ -}}
{{- $seen := dict -}}
{{- $slugs := dict -}}
{{- range $i, $q := $v.queues -}}
{{- $name := toString $q.name -}}
{{- if not (regexMatch "^[a-z0-9_-]{1,64}$" $name) -}}
{{- fail (printf "queues[%d]: queue name %q must match [a-z0-9_-]{1,64}" $i $name) -}}
{{- end -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "queues[%d]: queue %q is declared twice" $i $name) -}}
{{- end -}}
{{- $_ := set $seen $name true -}}
{{- $slug := include "tally.queueSlug" $name -}}
{{- if hasKey $slugs $slug -}}
{{- fail (printf "queues[%d]: queues %q and %q map to the same Kubernetes name %q: rename one" $i (get $slugs $slug) $name $slug) -}}
{{- end -}}
{{- $_ := set $slugs $slug $name -}}
{{- $backoff := 1000 -}}{{- if hasKey $q "backoff_ms" -}}{{- $backoff = int64 $q.backoff_ms -}}{{- end -}}
{{- $backoffMax := 300000 -}}{{- if hasKey $q "backoff_max_ms" -}}{{- $backoffMax = int64 $q.backoff_max_ms -}}{{- end -}}
{{- if lt (int64 $backoffMax) (int64 $backoff) -}}
{{- fail (printf "queue %q: backoff_max_ms (%d) must be at least backoff_ms (%d)" $name (int64 $backoffMax) (int64 $backoff)) -}}
{{- end -}}
{{- end -}}
{{- /* Workers: one per declared queue, exactly one way to run jobs, sane autoscaling. */ -}}
{{- $declared := include "tally.queueNames" . | fromJsonArray -}}
{{- $workerNames := dict -}}
{{- range $i, $w := $v.workers -}}
{{- $queue := toString $w.queue -}}
{{- if not (has $queue $declared) -}}
{{- fail (printf "workers[%d]: queue %q is not declared: add it to `queues` (declared: %s)" $i $queue (join ", " $declared)) -}}
{{- end -}}
{{- $hasCommand := and (hasKey $w "command") $w.command -}}
{{- $hasWebhook := and (hasKey $w "webhookUrl") $w.webhookUrl -}}
{{- if and $hasCommand $hasWebhook -}}
{{- fail (printf "workers[%d] (queue %q): set command or webhookUrl, not both" $i $queue) -}}
{{- end -}}
{{- if not (or $hasCommand $hasWebhook) -}}
{{- fail (printf "workers[%d] (queue %q): set command (each job's payload on stdin, exit 0 acks) or webhookUrl (each payload POSTed, 2xx acks)" $i $queue) -}}
{{- end -}}
{{- $wname := include "tally.workerName" (dict "root" $ "queue" $queue) -}}
{{- if hasKey $workerNames $wname -}}
{{- fail (printf "workers[%d]: queue %q already has a worker (one worker entry per queue; raise its replicas or concurrency)" $i $queue) -}}
{{- end -}}
{{- $_ := set $workerNames $wname $queue -}}
{{- $as := $w.autoscale | default dict -}}
{{- if $as.enabled -}}
{{- if not $as.prometheusAddress -}}
{{- fail (printf "workers[%d] (queue %q): autoscale.prometheusAddress is required with autoscale.enabled: the Prometheus that scrapes the brokers' tally_broker_depth_jobs" $i $queue) -}}
{{- end -}}
{{- $min := 1 -}}{{- if hasKey $as "minReplicas" -}}{{- $min = int $as.minReplicas -}}{{- end -}}
{{- $max := 20 -}}{{- if hasKey $as "maxReplicas" -}}{{- $max = int $as.maxReplicas -}}{{- end -}}
{{- if gt $min $max -}}
{{- fail (printf "workers[%d] (queue %q): autoscale.minReplicas (%d) is above autoscale.maxReplicas (%d)" $i $queue $min $max) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* Kafka: no secret in the ConfigMap; a password wherever SASL needs one and
only there. */ -}}
{{- $client := $v.kafka.client | default dict -}}
{{- range $key, $_ := $client -}}
{{- if or (contains "password" (lower $key)) (contains "secret" (lower $key)) (eq (lower $key) "ssl.key.pem") -}}
{{- fail (printf "kafka.client %q would put a secret in the ConfigMap: keep it in a Secret (kafka.sasl.existingSecret for sasl.password, kafka.tlsKeyPasswordKey for ssl.key.password, a key file in kafka.tlsSecret for ssl.key.pem)" $key) -}}
{{- end -}}
{{- end -}}
{{- $protocol := index $client "security.protocol" | default "PLAINTEXT" | upper -}}
{{- $mechanism := index $client "sasl.mechanism" | default (index $client "sasl.mechanisms") | default "GSSAPI" | upper -}}
{{- $needsPassword := and (hasPrefix "SASL_" $protocol) (has $mechanism (list "PLAIN" "SCRAM-SHA-256" "SCRAM-SHA-512")) -}}
{{- $sasl := $v.kafka.sasl | default dict -}}
{{- if $sasl.existingSecret -}}
{{- if not $sasl.passwordKey -}}
{{- fail (printf "kafka.sasl.existingSecret is %q but kafka.sasl.passwordKey is empty: name the key of that Secret holding the SASL password" $sasl.existingSecret) -}}
{{- end -}}
{{- if not $needsPassword -}}
{{- fail (printf "kafka.sasl.existingSecret is set but no setting uses its password: kafka.client needs \"security.protocol\" SASL_SSL or SASL_PLAINTEXT (now %s) and \"sasl.mechanism\" PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (now %s)" $protocol $mechanism) -}}
{{- end -}}
{{- else if $needsPassword -}}
{{- fail (printf "kafka.client \"security.protocol\" %s with \"sasl.mechanism\" %s needs a password: set kafka.sasl.existingSecret (and kafka.sasl.passwordKey) to the Secret holding it" $protocol $mechanism) -}}
{{- end -}}
{{- if $v.kafka.tlsKeyPasswordKey -}}
{{- if not $v.kafka.tlsSecret -}}
{{- fail "kafka.tlsKeyPasswordKey names a key of kafka.tlsSecret, which is not set: set kafka.tlsSecret to the Secret holding the client key and its password" -}}
{{- end -}}
{{- if not (index $client "ssl.key.location") -}}
{{- fail "kafka.tlsKeyPasswordKey is set but kafka.client has no \"ssl.key.location\": the password is for that key (e.g. /etc/kafka-tls/client.key)" -}}
{{- end -}}
{{- end -}}
{{- /* Snapshots: S3 settings only with an S3 url; credentials from a Secret with
both keys named. */ -}}
{{- $snap := $v.snapshots | default dict -}}
{{- if not $snap.url -}}
{{- if $snap.credentialsSecret -}}
{{- fail (printf "snapshots.credentialsSecret is %q but snapshots.url is empty: the credentials are for an S3-compatible store, set snapshots.url to s3://bucket/prefix (or leave credentialsSecret empty to keep snapshots on the counter pods' volumes)" $snap.credentialsSecret) -}}
{{- end -}}
{{- if $snap.endpoint -}}
{{- fail (printf "snapshots.endpoint is %q but snapshots.url is empty: set snapshots.url to s3://bucket/prefix for the store at that endpoint" $snap.endpoint) -}}
{{- end -}}
{{- end -}}
{{- if $snap.credentialsSecret -}}
{{- if not (and $snap.accessKeyIdKey $snap.secretAccessKeyKey) -}}
{{- fail (printf "snapshots.credentialsSecret is %q but snapshots.accessKeyIdKey or snapshots.secretAccessKeyKey is empty: name the keys of that Secret holding the access key id and the secret access key" $snap.credentialsSecret) -}}
{{- end -}}
{{- else if $snap.sessionTokenKey -}}
{{- fail "snapshots.sessionTokenKey names a key of snapshots.credentialsSecret, which is not set: set snapshots.credentialsSecret to the Secret holding the credentials" -}}
{{- end -}}
{{- if and (hasPrefix "http://" (toString $snap.endpoint)) (not $snap.allowHttp) -}}
{{- fail (printf "snapshots.endpoint %q is plain HTTP: set snapshots.allowHttp to true (or use an https:// endpoint)" $snap.endpoint) -}}
{{- end -}}
{{- /* Tokens: in the chart's Secret or in yours, not both. */ -}}
{{- $auth := $v.auth -}}
{{- range $role := list "reader" "worker" "operator" "cluster" -}}
{{- $token := index $auth (printf "%sToken" $role) -}}
{{- if and $auth.existingSecret $token -}}
{{- fail (printf "auth.existingSecret is set: put the tokens in that Secret and leave auth.%sToken empty" $role) -}}
{{- end -}}
{{- if and $token (not (index $auth (printf "%sTokenKey" $role))) -}}
{{- fail (printf "auth.%sToken is set: auth.%sTokenKey must name its key in the Secret" $role $role) -}}
{{- end -}}
{{- end -}}
{{- /* A read API reachable from outside the cluster asks for the readers' token. */ -}}
{{- if and (ne (toString $v.query.service.type) "ClusterIP") (not (include "tally.tokenSecret" (dict "root" $ "role" "reader"))) -}}
{{- fail (printf "query.service.type is %s: set auth.readerToken (or auth.existingSecret with auth.readerTokenKey), or the read API is open to anyone who reaches it" $v.query.service.type) -}}
{{- end -}}
{{- end -}}

{{/* tally.toml: the ConfigMap of the services (its checksum rolls them) and, with
queues.toml, the topics hook's. */}}
{{- define "tally.configToml" -}}
tally.toml: |
  # tally.toml of the {{ .Release.Name }} release (helm/tally). Every container also gets
  # TALLY__SECTION__KEY variables (tokens and Kafka passwords from Secrets, per-pod and
  # per-worker settings), which win.
  [kafka]
  bootstrap_servers = {{ .Values.kafka.bootstrapServers | toString | toJson }}
  topic_prefix = {{ .Values.kafka.topicPrefix | toString | toJson }}
  max_message_bytes = {{ .Values.kafka.maxMessageBytes | int64 }}

  [kafka.client]
  {{- range $key, $value := .Values.kafka.client }}
  {{ $key | toJson }} = {{ $value | toString | toJson }}
  {{- end }}

  [counting]
  dedupe_window = {{ .Values.counting.dedupeWindow | toString | toJson }}
  max_segment_combinations = {{ .Values.counting.maxSegmentCombinations | int64 }}
  resolutions = [
  {{- range .Values.counting.resolutions }}
    { width = {{ .width | toString | toJson }}, retention = {{ .retention | toString | toJson }} },
  {{- end }}
  ]
  [counting.dimensions]
  {{- range $metric, $names := .Values.counting.dimensions }}
  {{ $metric | toJson }} = {{ $names | toJson }}
  {{- end }}

  [log]
  format = {{ .Values.log.format | toJson }}
  level = {{ .Values.log.level | toString | toJson }}
  {{- with .Values.telemetry.otlpEndpoint }}

  [telemetry]
  otlp_endpoint = {{ . | toJson }}
  {{- end }}

  [ingester]
  admin_listen = "0.0.0.0:9101"
  shard_record_format = {{ .Values.ingester.shardRecordFormat | default 4 | int }}

  [counter]
  admin_listen = "0.0.0.0:9102"
  read_listen = "0.0.0.0:7000"
  data_dir = "/var/lib/tally/counter"
  standby_replicas = {{ .Values.counter.standbyReplicas | default 0 | int64 }}
  block_cache_bytes = {{ .Values.counter.blockCacheBytes | default 67108864 | int64 }}

  [snapshots]
  {{- $snap := .Values.snapshots }}
  enabled = {{ if $snap.enabled }}true{{ else }}false{{ end }}
  {{- if $snap.url }}
  # In an S3-compatible store. The credentials are not in this file: they come from the
  # counter and graph containers' AWS_* variables (snapshots.credentialsSecret) or the pods' AWS identity.
  url = {{ $snap.url | toString | toJson }}
  endpoint = {{ $snap.endpoint | default "" | toString | toJson }}
  region = {{ $snap.region | toString | toJson }}
  allow_http = {{ if $snap.allowHttp }}true{{ else }}false{{ end }}
  {{- else }}
  # On each counter pod's own volume (it survives restarts and rescheduling).
  dir = "/var/lib/tally/counter/snapshots"
  {{- end }}
  every_records = {{ $snap.everyRecords | int64 }}
  interval_ms = {{ $snap.intervalMs | int64 }}
  keep = {{ $snap.keep | int64 }}
  orphan_grace_ms = {{ $snap.orphanGraceMs | int64 }}

  [graph]
  admin_listen = "0.0.0.0:9104"
  read_listen = "0.0.0.0:7001"
  # A folder in the volume, not its mount point: on a new, empty volume the graph
  # has no store yet, so it restores its newest snapshot (from snapshots.url).
  data_dir = "/var/lib/tally/graph/store"
  max_descendants = {{ .Values.graph.maxDescendants | int64 }}

  [query]
  listen = "0.0.0.0:8080"
  admin_listen = "0.0.0.0:9103"

  [broker]
  listen = "0.0.0.0:8090"
  admin_listen = "0.0.0.0:9105"
  declarations = "/etc/tally/queues.toml"

  [worker]
  brokers = [{{ printf "http://%s-broker:8090" (include "tally.fullname" .) | toJson }}]
  admin_listen = "0.0.0.0:9106"
{{- end -}}

{{/* queues.toml: the queues ConfigMap (outside every checksum: see
tally.podAnnotations) and the topics hook's copy. */}}
{{- define "tally.queuesToml" -}}
queues.toml: |
  # Queues declared in the chart's `queues` value, on top of the built-in ones.
  {{- range .Values.queues }}
  {{- $q := . }}

  [[queue]]
  name = {{ .name | toString | toJson }}
  partitions = {{ .partitions | int64 }}
  {{- if hasKey $q "fifo" }}
  fifo = {{ if $q.fifo }}true{{ else }}false{{ end }}
  {{- end }}
  {{- range $key := list "rate_limit_per_sec" "max_attempts" "backoff_ms" "backoff_max_ms" "lease_ms" "max_lease_ms" "max_retry_ms" "buffer" "delayed_buffer" "buffer_bytes" "retention_ms" "priority_levels" "priority_aging_ms" "wait_slo_ms" "unique_for_ms" "debounce_ms" }}
  {{- if hasKey $q $key }}
  {{ $key }} = {{ index $q $key | int64 }}
  {{- end }}
  {{- end }}
  {{- if hasKey $q "on_duplicate" }}
  on_duplicate = {{ $q.on_duplicate | toString | toJson }}
  {{- end }}
  {{- if hasKey $q "limits" }}
  {{- $l := $q.limits }}

  [queue.limits]
  {{- range $key := list "per_key" "total" }}
  {{- if hasKey $l $key }}
  {{ $key }} = {{ index $l $key | int64 }}
  {{- end }}
  {{- end }}
  {{- range $key := list "key_field" "at_limit" }}
  {{- if hasKey $l $key }}
  {{ $key }} = {{ index $l $key | toString | toJson }}
  {{- end }}
  {{- end }}
  {{- range $l.overrides }}

  [[queue.limits.overrides]]
  pattern = {{ .pattern | toString | toJson }}
  per_key = {{ .per_key | int64 }}
  {{- end }}
  {{- end }}
  {{- range $q.schedule }}
  {{- $s := . }}

  [[queue.schedule]]
  name = {{ .name | toString | toJson }}
  cron = {{ .cron | toString | toJson }}
  {{- range $key := list "time_zone" "missed" }}
  {{- if hasKey $s $key }}
  {{ $key }} = {{ index $s $key | toString | toJson }}
  {{- end }}
  {{- end }}
  {{- if hasKey . "priority" }}
  priority = {{ .priority | int64 }}
  {{- end }}
  {{- if hasKey . "payload" }}
  payload = {{ include "tally.tomlValue" .payload }}
  {{- end }}
  {{- end }}
  {{- end }}
{{- end -}}

{{/* A values tree as a TOML value: tables inline, numbers and strings as JSON writes
them (valid TOML); the schema refuses null, which TOML has not. */}}
{{- define "tally.tomlValue" -}}
{{- if kindIs "map" . -}}
{ {{- $first := true }}{{ range $key, $value := . }}{{ if not $first }}, {{ end }}{{ $first = false }}{{ $key | toJson }} = {{ include "tally.tomlValue" $value }}{{ end -}} }
{{- else if kindIs "slice" . -}}
[{{ range $i, $value := . }}{{ if $i }}, {{ end }}{{ include "tally.tomlValue" $value }}{{ end }}]
{{- else if and (kindIs "float64" .) (eq (floor .) .) -}}
{{ int64 . }}
{{- else -}}
{{ toJson . }}
{{- end -}}
{{- end -}}

{{/* Both files: the topics hook's ConfigMap, a copy of the two above. */}}
{{- define "tally.configData" -}}
{{ include "tally.configToml" . }}
{{ include "tally.queuesToml" . }}
{{- end -}}

{{/* The environment every tally container shares. */}}
{{- define "tally.env" -}}
- name: TALLY_CONFIG
  value: /etc/tally/tally.toml
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* A service's async runtime: (dict "threads" .Values.<service>.workerThreads "root" $);
1 thread when unset (the schema refuses 0), and the chart's one CPU slice for request
threads (100 µs when unset; 0 is kept). */}}
{{- define "tally.runtimeEnv" -}}
- name: TALLY__RUNTIME__WORKER_THREADS
  value: {{ .threads | default 1 | int | toString | quote }}
{{- $runtime := .root.Values.runtime | default dict }}
- name: TALLY__RUNTIME__LATENCY_SLICE_US
  value: {{ hasKey $runtime "latencySliceUs" | ternary $runtime.latencySliceUs 100 | int | toString | quote }}
{{- end -}}

{{/* The Kafka passwords, from the user's Secrets, for every container that talks to
Kafka (the workers do not); nothing when none is set. */}}
{{- define "tally.kafkaEnv" -}}
{{- $kafka := .Values.kafka -}}
{{- $sasl := $kafka.sasl | default dict -}}
{{- if and $sasl.existingSecret $sasl.passwordKey }}
- name: TALLY__KAFKA__CLIENT__SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $sasl.existingSecret }}
      key: {{ $sasl.passwordKey }}
{{- end }}
{{- if and $kafka.tlsSecret $kafka.tlsKeyPasswordKey }}
- name: TALLY__KAFKA__CLIENT__SSL_KEY_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $kafka.tlsSecret }}
      key: {{ $kafka.tlsKeyPasswordKey }}
{{- end }}
{{- end -}}

{{/* The S3 credentials of the snapshot store, from the user's Secret, for the
containers that take and restore snapshots (counter and graph); nothing when no
snapshots.credentialsSecret is set (the pods' own AWS identity, or no S3 at all). */}}
{{- define "tally.snapshotsEnv" -}}
{{- $snap := .Values.snapshots | default dict -}}
{{- if and $snap.url $snap.credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $snap.credentialsSecret }}
      key: {{ $snap.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $snap.credentialsSecret }}
      key: {{ $snap.secretAccessKeyKey }}
{{- if $snap.sessionTokenKey }}
- name: AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $snap.credentialsSecret }}
      key: {{ $snap.sessionTokenKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secret holding a role's token: (dict "root" $ "role" "reader"); nothing
when that role has no token. */}}
{{- define "tally.tokenSecret" -}}
{{- $auth := .root.Values.auth -}}
{{- if index $auth (printf "%sTokenKey" .role) -}}
{{- if $auth.existingSecret -}}
{{- $auth.existingSecret -}}
{{- else if index $auth (printf "%sToken" .role) -}}
{{- printf "%s-auth" (include "tally.fullname" .root) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The tokens of `roles` a service checks or sends, from the chart's Secret or the
user's: (dict "root" $ "roles" (list "reader" "cluster")); nothing for a role without
a token. */}}
{{- define "tally.tokenEnv" -}}
{{- $root := .root -}}
{{- range $role := .roles }}
{{- with include "tally.tokenSecret" (dict "root" $root "role" $role) }}
- name: TALLY__AUTH__{{ upper $role }}_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ index $root.Values.auth (printf "%sTokenKey" $role) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Probes on the admin port. The startup probe holds the liveness probe off while
a service waits for Kafka or its topics. */}}
{{- define "tally.probes" -}}
startupProbe:
  httpGet: { path: /healthz, port: admin }
  periodSeconds: 5
  failureThreshold: {{ .Values.probes.startupFailureThreshold }}
livenessProbe:
  httpGet: { path: /healthz, port: admin }
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet: { path: /readyz, port: admin }
  periodSeconds: 5
  timeoutSeconds: 5
{{- end -}}

{{/* Pod-level settings every tally pod shares. */}}
{{- define "tally.podSpec" -}}
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Container-level settings every tally container shares: (dict "root" $ "image"
"another/image:tag"), the image defaulting to tally's. */}}
{{- define "tally.container" -}}
image: {{ .image | default (include "tally.image" .root) | quote }}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
securityContext: {{- toYaml .root.Values.containerSecurityContext | nindent 2 }}
{{- end -}}

{{- define "tally.configMounts" -}}
- { name: config, mountPath: /etc/tally, readOnly: true }
{{- if .Values.kafka.tlsSecret }}
- { name: kafka-tls, mountPath: /etc/kafka-tls, readOnly: true }
{{- end }}
{{- end -}}

{{/* The /etc/tally volume: (dict "root" $ "configMaps" (list name…)), one projected
volume of every ConfigMap listed (tally.toml and queues.toml side by side). */}}
{{- define "tally.configVolumes" -}}
- name: config
  projected:
    sources:
      {{- range .configMaps }}
      - configMap: { name: {{ . }} }
      {{- end }}
{{- if .root.Values.kafka.tlsSecret }}
- name: kafka-tls
  secret: { secretName: {{ .root.Values.kafka.tlsSecret }} }
{{- end }}
{{- end -}}

{{/* The ConfigMaps a service mounts at /etc/tally: tally.toml's and the queues'. */}}
{{- define "tally.serviceConfigMaps" -}}
{{- list (include "tally.fullname" .) (printf "%s-queues" (include "tally.fullname" .)) | toJson -}}
{{- end -}}

{{/*
Annotations that roll pods when their configuration changes: tally.toml and the
tokens, and not queues.toml. A queues-only upgrade rolls no pod: the topics hook
applies the new declarations (new topics, and every queue written to the compacted
<prefix>queues topic) before the upgrade, and running brokers follow that topic and
serve a new queue or new settings live. The mounted queues.toml catches up by itself
when the kubelet syncs the ConfigMap volume (within a minute or so); a broker reads it
only when it starts, and then follows the topic anyway, so the lag changes nothing.
*/}}
{{- define "tally.podAnnotations" -}}
checksum/config: {{ include "tally.configToml" . | sha256sum }}
checksum/auth: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}
