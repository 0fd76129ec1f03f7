{{- define "modeld.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "modeld.serviceAccountName" -}}
{{- default (include "modeld.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "modeld.labels" -}}
app.kubernetes.io/name: modeld-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "modeld.selectorLabels" -}}
app.kubernetes.io/name: modeld-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
