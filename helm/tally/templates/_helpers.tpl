{{- define "tally.name" -}}{{ .Release.Name }}-tally{{- end -}}

{{- define "tally.labels" -}}
app.kubernetes.io/name: tally
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The environment every tally container shares: Kafka and the config file. */}}
{{- define "tally.env" -}}
- name: TALLY_CONFIG
  value: /etc/tally/tally.toml
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{- define "tally.probes" -}}
livenessProbe:
  httpGet: { path: /healthz, port: admin }
  periodSeconds: 10
readinessProbe:
  httpGet: { path: /readyz, port: admin }
  periodSeconds: 5
{{- end -}}
