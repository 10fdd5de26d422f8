{{- define "prefixgate.fullname" -}}
{{- printf "%s-prefixgate" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "prefixgate.labels" -}}
app.kubernetes.io/name: prefixgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "prefixgate.selector" -}}
app.kubernetes.io/name: prefixgate
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* the replica pods: also what the InferencePool and llm-d's pod discovery select */}}
{{- define "prefixgate.replicaSelector" -}}
{{ include "prefixgate.selector" . }}
app.kubernetes.io/component: replica
{{- end -}}

{{- define "prefixgate.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{- define "prefixgate.redisURL" -}}
{{ printf "redis://%s-redis:6379/0" (include "prefixgate.fullname" .) }}
{{- end -}}

{{/* settings every process shares: what a router must hash exactly as the replicas do */}}
{{- define "prefixgate.sharedEnv" -}}
- name: PREFIXGATE_HOST
  value: "0.0.0.0"
- name: PREFIXGATE_PORT
  value: "8000"
- name: PREFIXGATE_PAGE_SIZE
  value: {{ .Values.pageSize | quote }}
- name: PREFIXGATE_HASH_SEED
  value: {{ .Values.hashSeed | quote }}
- name: PREFIXGATE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: PREFIXGATE_METRICS_PUBLIC
  value: {{ ternary "on" "off" .Values.metrics.public | quote }}
{{- if .Values.model }}
- name: PREFIXGATE_MODEL
  value: {{ .Values.model | quote }}
{{- end }}
{{- if .Values.servedModelName }}
- name: PREFIXGATE_SERVED_MODEL_NAME
  value: {{ .Values.servedModelName | quote }}
{{- end }}
{{- if .Values.redis.enabled }}
- name: PREFIXGATE_REDIS_URL
  value: {{ include "prefixgate.redisURL" . | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "prefixgate.httpProbe" -}}
httpGet:
  path: /health
  port: http
{{- end -}}
